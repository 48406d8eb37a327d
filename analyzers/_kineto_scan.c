/* One pass over a JSON array of Kineto trace events, writing the columns the loader needs.
 *
 * Why C: on a 54 MB rank, msgspec's typed decode (0.11 CPU s) plus pulling the columns out of its
 * Python objects by comprehensions (0.12 s) were over half of a rank's parse (docs/loader.md,
 * "Parsing speed against HTA").  Here no Python object is made per event: numbers go straight into
 * C arrays and names into one UTF-8 buffer with offsets (an Arrow string column).
 *
 * Scope, on purpose narrow: the top-level keys ph, name, cat, ts, dur, pid, tid, and inside "args"
 * the four ids every row needs (External id, correlation, stream, device) and the allocator's six
 * fields (Total Allocated, Total Reserved, Device Type, Device Id, Bytes, Addr).  Every other args field is
 * left in the JSON: the caller decodes, with msgspec, only the args of the rows that need them, from
 * the byte span recorded here.  Anything this scanner does not handle the way the msgspec path does
 * (a string pid/tid/stream/device as ROCm writes, a float where an id or a byte count belongs, a lone surrogate,
 * malformed JSON) raises Unsupported, and the caller decodes that batch with msgspec instead, so the
 * two paths give the same table and the msgspec path words the errors.
 *
 * scan(buffer) -> {column: bytes}, one row an event, plus "n" (the rows) and "non_ascii":
 *   ph: one byte (the one-character phase, 0 when missing or longer); ts: float64, NaN when missing
 *   or null; dur: float64, 0 when missing; pid, tid: int64, 0 when missing; args_start, args_end:
 *   int64 byte offsets of the "args" object, -1 when absent or null; name_offsets/cat_offsets: int32
 *   (n + 1) and name_data/cat_data: the unescaped UTF-8 (an Arrow string column); device, stream,
 *   correlation, external_id: int64, -1 when absent or null; total_allocated, total_reserved,
 *   device_type, device_id, bytes, addr (the allocator's [memory] events): int64, INT64_MIN when
 *   absent or null; non_ascii: whether a name or category has a byte >= 0x80 (the caller then
 *   validates the UTF-8).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *Unsupported;

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra) cap *= 2;
    char *q = realloc(b->p, cap);
    if (!q) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = q;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const void *src, size_t n) {
    if (buf_reserve(b, n)) return -1;
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

typedef struct {
    const char *p, *end, *base;
    const char *why; /* set when the input is outside this scanner's scope */
} Scanner;

static int unsupported(Scanner *s, const char *why) {
    if (!s->why) s->why = why;
    return -1;
}

static inline void skip_ws(Scanner *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t')) s->p++;
}

static inline int expect(Scanner *s, char c) {
    skip_ws(s);
    if (s->p >= s->end || *s->p != c) return unsupported(s, "unexpected character");
    s->p++;
    return 0;
}

/* s->p at the opening quote.  The raw content is [*a, *z); s->p ends past the closing quote. */
static int scan_string(Scanner *s, const char **a, const char **z) {
    const char *start = s->p + 1, *q = start;
    for (;;) {
        const char *hit = memchr(q, '"', (size_t)(s->end - q));
        if (!hit) return unsupported(s, "unterminated string");
        const char *b = hit;
        while (b > start && b[-1] == '\\') b--;
        if (((hit - b) & 1) == 0) { /* an even run of backslashes: the quote closes the string */
            *a = start;
            *z = hit;
            s->p = hit + 1;
            return 0;
        }
        q = hit + 1;
    }
}

static int hex4(Scanner *s, const char *p, const char *end, unsigned *out) {
    if (end - p < 4) return unsupported(s, "short \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return unsupported(s, "bad \\u escape");
    }
    *out = v;
    return 0;
}

/* Append the JSON string content [a, z) to out, escapes decoded to UTF-8. */
static int put_string(Scanner *s, const char *a, const char *z, Buf *out) {
    while (a < z) {
        const char *bs = memchr(a, '\\', (size_t)(z - a));
        const char *run_end = bs ? bs : z;
        if (buf_put(out, a, (size_t)(run_end - a))) return -1;
        if (!bs) return 0;
        if (bs + 1 >= z) return unsupported(s, "dangling escape");
        char c = bs[1], ch;
        a = bs + 2;
        switch (c) {
        case '"': ch = '"'; break;
        case '\\': ch = '\\'; break;
        case '/': ch = '/'; break;
        case 'b': ch = '\b'; break;
        case 'f': ch = '\f'; break;
        case 'n': ch = '\n'; break;
        case 'r': ch = '\r'; break;
        case 't': ch = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (hex4(s, a, z, &cp)) return -1;
            a += 4;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return unsupported(s, "lone low surrogate");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (z - a < 6 || a[0] != '\\' || a[1] != 'u' || hex4(s, a + 2, z, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return unsupported(s, "lone high surrogate");
                a += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            char u[4];
            size_t k;
            if (cp < 0x80) { u[0] = (char)cp; k = 1; }
            else if (cp < 0x800) { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); k = 2; }
            else if (cp < 0x10000) {
                u[0] = (char)(0xE0 | (cp >> 12)); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
                u[2] = (char)(0x80 | (cp & 0x3F)); k = 3;
            } else {
                u[0] = (char)(0xF0 | (cp >> 18)); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
                u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F)); k = 4;
            }
            if (buf_put(out, u, k)) return -1;
            continue;
        }
        default:
            return unsupported(s, "bad escape");
        }
        if (buf_put(out, &ch, 1)) return -1;
    }
    return 0;
}

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A JSON number at s->p.  *is_int: no fraction or exponent and it fits int64 (then *iv holds it).
 * *d: its value as a correctly rounded double -- exactly when the digits fit 2^53 and the
 * fraction has at most 22 digits (both operands of the division are then exact, so IEEE division
 * rounds once, correctly: Clinger's fast path), else by CPython's dtoa. */
static int scan_number(Scanner *s, double *d, int64_t *iv, int *is_int) {
    const char *p = s->p, *start = p;
    int neg = 0, frac = 0, exp_part = 0, overflow = 0;
    uint64_t m = 0;
    if (p < s->end && *p == '-') { neg = 1; p++; }
    if (p >= s->end || *p < '0' || *p > '9') return unsupported(s, "bad number");
    if (*p == '0') {
        p++;
    } else {
        while (p < s->end && *p >= '0' && *p <= '9') {
            if (m > (UINT64_MAX - 9) / 10) overflow = 1;
            else m = m * 10 + (uint64_t)(*p - '0');
            p++;
        }
    }
    if (p < s->end && *p == '.') {
        p++;
        if (p >= s->end || *p < '0' || *p > '9') return unsupported(s, "bad number");
        while (p < s->end && *p >= '0' && *p <= '9') {
            if (m > (UINT64_MAX - 9) / 10) overflow = 1;
            else m = m * 10 + (uint64_t)(*p - '0');
            frac++;
            p++;
        }
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        exp_part = 1;
        p++;
        if (p < s->end && (*p == '+' || *p == '-')) p++;
        if (p >= s->end || *p < '0' || *p > '9') return unsupported(s, "bad number");
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    }
    s->p = p;
    *is_int = !frac && !exp_part && !overflow && m <= (uint64_t)INT64_MAX;
    if (*is_int) *iv = neg ? -(int64_t)m : (int64_t)m;
    if (!d) return 0;
    if (!overflow && !exp_part && m <= (1ULL << 53) && frac <= 22) {
        double v = (double)m / POW10[frac];
        *d = neg ? -v : v;
        return 0;
    }
    char tmp[128];
    size_t len = (size_t)(p - start);
    if (len >= sizeof tmp) return unsupported(s, "number too long");
    memcpy(tmp, start, len);
    tmp[len] = 0;
    double v = PyOS_string_to_double(tmp, NULL, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return unsupported(s, "bad number");
    }
    *d = v;
    return 0;
}

static int skip_value(Scanner *s, int depth);

static int skip_literal(Scanner *s, const char *word, size_t n) {
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return unsupported(s, "bad literal");
    s->p += n;
    return 0;
}

static int skip_value(Scanner *s, int depth) {
    const char *a, *z;
    double d;
    int64_t iv;
    int is_int;
    if (depth > 512) return unsupported(s, "nested too deep");
    skip_ws(s);
    if (s->p >= s->end) return unsupported(s, "truncated");
    switch (*s->p) {
    case '"':
        return scan_string(s, &a, &z);
    case '{':
        s->p++;
        skip_ws(s);
        if (s->p < s->end && *s->p == '}') { s->p++; return 0; }
        for (;;) {
            skip_ws(s);
            if (s->p >= s->end || *s->p != '"' || scan_string(s, &a, &z) || expect(s, ':') || skip_value(s, depth + 1))
                return unsupported(s, "bad object");
            skip_ws(s);
            if (s->p < s->end && *s->p == ',') { s->p++; continue; }
            return expect(s, '}');
        }
    case '[':
        s->p++;
        skip_ws(s);
        if (s->p < s->end && *s->p == ']') { s->p++; return 0; }
        for (;;) {
            if (skip_value(s, depth + 1)) return -1;
            skip_ws(s);
            if (s->p < s->end && *s->p == ',') { s->p++; continue; }
            return expect(s, ']');
        }
    case 't': return skip_literal(s, "true", 4);
    case 'f': return skip_literal(s, "false", 5);
    case 'n': return skip_literal(s, "null", 4);
    default:
        (void)d;
        return scan_number(s, NULL, &iv, &is_int);
    }
}

static inline int is_null(Scanner *s) {
    if (s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0) {
        s->p += 4;
        return 1;
    }
    return 0;
}

/* An integer id (pid, tid, or one of args' ids) or null (-> keep the default). */
static int scan_id(Scanner *s, int64_t *out) {
    int64_t iv;
    int is_int;
    if (is_null(s)) return 0;
    if (s->p < s->end && *s->p == '"') return unsupported(s, "string id");
    if (scan_number(s, NULL, &iv, &is_int)) return -1;
    if (!is_int) return unsupported(s, "non-integer id");
    *out = iv;
    return 0;
}

static inline int key_is(const char *a, const char *z, const char *word, size_t n) {
    return (size_t)(z - a) == n && memcmp(a, word, n) == 0;
}
#define KEY(word) key_is(ka, kz, word, sizeof(word) - 1)

/* The ids and the allocator's fields an event's args hold (an id left at its default when absent). */
typedef struct {
    int64_t dev, stream, corr, ext;
    int64_t allocated, reserved, dev_type, dev_id, bytes, addr; /* [memory] events; MISSING when absent */
} Args;

#define MISSING INT64_MIN

static int scan_args(Scanner *s, Args *out) {
    const char *ka, *kz;
    s->p++; /* '{' */
    skip_ws(s);
    if (s->p < s->end && *s->p == '}') { s->p++; return 0; }
    for (;;) {
        skip_ws(s);
        if (s->p >= s->end || *s->p != '"') return unsupported(s, "bad args key");
        if (scan_string(s, &ka, &kz)) return -1;
        if (memchr(ka, '\\', (size_t)(kz - ka))) return unsupported(s, "escaped key");
        if (expect(s, ':')) return -1;
        skip_ws(s);
        int rc;
        if (KEY("External id")) rc = scan_id(s, &out->ext);
        else if (KEY("correlation")) rc = scan_id(s, &out->corr);
        else if (KEY("stream")) rc = scan_id(s, &out->stream);
        else if (KEY("device")) rc = scan_id(s, &out->dev);
        else if (KEY("Total Allocated")) rc = scan_id(s, &out->allocated);
        else if (KEY("Total Reserved")) rc = scan_id(s, &out->reserved);
        else if (KEY("Device Type")) rc = scan_id(s, &out->dev_type);
        else if (KEY("Device Id")) rc = scan_id(s, &out->dev_id);
        else if (KEY("Bytes")) rc = scan_id(s, &out->bytes);
        else if (KEY("Addr")) rc = scan_id(s, &out->addr);
        else rc = skip_value(s, 1);
        if (rc) return -1;
        skip_ws(s);
        if (s->p < s->end && *s->p == ',') { s->p++; continue; }
        return expect(s, '}');
    }
}

typedef struct {
    Buf ph, ts, dur, pid, tid, astart, aend, name_off, name_data, cat_off, cat_data;
    Buf dev, stream, corr, ext, allocated, reserved, dev_type, dev_id, bytes, addr; /* as in Args */
    int non_ascii;
} Columns;

static const Args NO_ARGS = {-1, -1, -1, -1, MISSING, MISSING, MISSING, MISSING, MISSING, MISSING};

static int put_text(Scanner *s, const char *a, const char *z, Buf *off, Buf *data, int *non_ascii) {
    if (a) {
        for (const char *c = a; c < z; c++) {
            if ((unsigned char)*c >= 0x80) { *non_ascii = 1; break; }
        }
        if (memchr(a, '\\', (size_t)(z - a))) {
            if (put_string(s, a, z, data)) return -1;
        } else if (buf_put(data, a, (size_t)(z - a))) {
            return -1;
        }
    }
    if (data->len > INT32_MAX) return unsupported(s, "batch too large");
    int32_t o = (int32_t)data->len;
    return buf_put(off, &o, sizeof o);
}

static int scan_event(Scanner *s, Columns *c) {
    const char *ka, *kz, *na = NULL, *nz = NULL, *ca = NULL, *cz = NULL;
    char ph = 0;
    double ts = NAN, dur = 0.0;
    int64_t pid = 0, tid = 0, astart = -1, aend = -1, iv;
    Args args = NO_ARGS;
    int is_int;
    s->p++; /* '{' */
    skip_ws(s);
    if (s->p < s->end && *s->p == '}') {
        s->p++;
    } else {
        for (;;) {
            skip_ws(s);
            if (s->p >= s->end || *s->p != '"') return unsupported(s, "bad event key");
            if (scan_string(s, &ka, &kz)) return -1;
            if (memchr(ka, '\\', (size_t)(kz - ka))) return unsupported(s, "escaped key");
            if (expect(s, ':')) return -1;
            skip_ws(s);
            if (s->p >= s->end) return unsupported(s, "truncated");
            int rc = 0;
            if (KEY("ph")) {
                const char *a, *z;
                if (*s->p != '"' || scan_string(s, &a, &z)) return unsupported(s, "ph is not a string");
                if (memchr(a, '\\', (size_t)(z - a))) return unsupported(s, "escaped ph");
                ph = (z - a == 1) ? *a : 0;
            } else if (KEY("name") || KEY("cat")) {
                const char *a, *z;
                if (*s->p != '"' || scan_string(s, &a, &z)) return unsupported(s, "name/cat is not a string");
                if (KEY("name")) { na = a; nz = z; } else { ca = a; cz = z; }
            } else if (KEY("ts")) {
                if (is_null(s)) ts = NAN;
                else rc = scan_number(s, &ts, &iv, &is_int);
            } else if (KEY("dur")) {
                rc = scan_number(s, &dur, &iv, &is_int);
            } else if (KEY("pid")) {
                if (is_null(s)) return unsupported(s, "null pid");
                rc = scan_id(s, &pid);
            } else if (KEY("tid")) {
                if (is_null(s)) return unsupported(s, "null tid");
                rc = scan_id(s, &tid);
            } else if (KEY("args")) {
                args = NO_ARGS;
                if (is_null(s)) {
                    astart = aend = -1;
                } else if (*s->p == '{') {
                    astart = s->p - s->base;
                    rc = scan_args(s, &args);
                    aend = s->p - s->base;
                } else {
                    return unsupported(s, "args is not an object");
                }
            } else {
                rc = skip_value(s, 1);
            }
            if (rc) return -1;
            skip_ws(s);
            if (s->p < s->end && *s->p == ',') { s->p++; continue; }
            if (expect(s, '}')) return -1;
            break;
        }
    }
    if (buf_put(&c->ph, &ph, 1) || buf_put(&c->ts, &ts, 8) || buf_put(&c->dur, &dur, 8) || buf_put(&c->pid, &pid, 8)
        || buf_put(&c->tid, &tid, 8) || buf_put(&c->astart, &astart, 8) || buf_put(&c->aend, &aend, 8)
        || buf_put(&c->dev, &args.dev, 8) || buf_put(&c->stream, &args.stream, 8) || buf_put(&c->corr, &args.corr, 8)
        || buf_put(&c->ext, &args.ext, 8) || buf_put(&c->allocated, &args.allocated, 8)
        || buf_put(&c->reserved, &args.reserved, 8) || buf_put(&c->dev_type, &args.dev_type, 8)
        || buf_put(&c->dev_id, &args.dev_id, 8) || buf_put(&c->bytes, &args.bytes, 8) || buf_put(&c->addr, &args.addr, 8)
        || put_text(s, na, nz, &c->name_off, &c->name_data, &c->non_ascii)
        || put_text(s, ca, cz, &c->cat_off, &c->cat_data, &c->non_ascii))
        return -1;
    return 0;
}

static void free_columns(Columns *c) {
    Buf *all[] = {&c->ph, &c->ts, &c->dur, &c->pid, &c->tid, &c->astart, &c->aend, &c->name_off, &c->name_data,
                  &c->cat_off, &c->cat_data, &c->dev, &c->stream, &c->corr, &c->ext, &c->allocated, &c->reserved,
                  &c->dev_type, &c->dev_id, &c->bytes, &c->addr};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->p);
}

static PyObject *as_bytes(Buf *b) { return PyBytes_FromStringAndSize(b->p ? b->p : "", (Py_ssize_t)b->len); }

static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Scanner s = {(const char *)view.buf, (const char *)view.buf + view.len, (const char *)view.buf, NULL};
    Columns c;
    memset(&c, 0, sizeof c);
    Py_ssize_t n = 0;
    int32_t zero = 0;
    int rc = buf_put(&c.name_off, &zero, 4) || buf_put(&c.cat_off, &zero, 4) ? -1 : 0;
    if (!rc) rc = expect(&s, '[');
    if (!rc) {
        skip_ws(&s);
        if (s.p < s.end && *s.p == ']') {
            s.p++;
        } else {
            for (;;) {
                skip_ws(&s);
                if (s.p >= s.end || *s.p != '{') { rc = unsupported(&s, "an event is not an object"); break; }
                if (scan_event(&s, &c)) { rc = -1; break; }
                n++;
                skip_ws(&s);
                if (s.p < s.end && *s.p == ',') { s.p++; continue; }
                rc = expect(&s, ']');
                break;
            }
        }
    }
    if (!rc) {
        skip_ws(&s);
        if (s.p != s.end) rc = unsupported(&s, "data after the array");
    }
    PyObject *out = NULL;
    if (rc) {
        if (!PyErr_Occurred())
            PyErr_Format(Unsupported, "%s at byte %zd", s.why ? s.why : "unsupported input", (Py_ssize_t)(s.p - s.base));
    } else {
        out = Py_BuildValue(
            "{s:n,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:O}",
            "n", n, "ph", as_bytes(&c.ph), "ts", as_bytes(&c.ts), "dur", as_bytes(&c.dur), "pid", as_bytes(&c.pid),
            "tid", as_bytes(&c.tid), "args_start", as_bytes(&c.astart), "args_end", as_bytes(&c.aend),
            "name_offsets", as_bytes(&c.name_off), "name_data", as_bytes(&c.name_data),
            "cat_offsets", as_bytes(&c.cat_off), "cat_data", as_bytes(&c.cat_data), "device", as_bytes(&c.dev),
            "stream", as_bytes(&c.stream), "correlation", as_bytes(&c.corr), "external_id", as_bytes(&c.ext),
            "total_allocated", as_bytes(&c.allocated), "total_reserved", as_bytes(&c.reserved),
            "device_type", as_bytes(&c.dev_type), "device_id", as_bytes(&c.dev_id), "bytes", as_bytes(&c.bytes),
            "addr", as_bytes(&c.addr), "non_ascii", c.non_ascii ? Py_True : Py_False);
    }
    free_columns(&c);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "scan(buffer) -> the event columns of a JSON array of Kineto events (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kineto_scan",
                                    "Kineto trace events -> columns, in one C pass (analyzers/kineto_json.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kineto_scan(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Unsupported = PyErr_NewException("_kineto_scan.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObject(m, "Unsupported", Unsupported) < 0) {
        Py_XDECREF(Unsupported);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(Unsupported);
    return m;
}
