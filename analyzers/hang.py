"""Why a job hung: every rank's record of its collectives, read across ranks (``mfuscope hang DIR``).

The records are a run directory's write-ahead records (``collectives/rank<N>.jsonl``, written by
the collectors before each call is issued and when it completes: they survive a rank killed by a
signal) or PyTorch Flight Recorder dumps (any job's, or the ones a run writes when it ends early).

Flight Recorder keeps, per rank, a ring buffer of the last collectives each process group issued:
the group (name, description), its per-group sequence number (``collective_seq_id``), the op
(``profiling_name``, e.g. ``nccl:all_reduce``), input sizes and dtypes, the Python stack, and on
NCCL the state (scheduled, started, completed).  torchtitan turns it on by default; any torchrun
job does with ``TORCH_FR_BUFFER_SIZE=2000`` (and, on NCCL, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with
``TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_`` for where the dumps go); a running job's dump is also
``torch._C._distributed_c10d._dump_fr_trace()``.

A hang is the first sequence number of a group that not every member got through.  Each member is
then classified at that number:

- ``never_entered``: its last entry of the group is an earlier one (it is elsewhere: a rank stuck on
  the CPU, in a data loader, in another group's collective) -- most watchdog timeouts are this;
- ``desync``: it entered that number with another op, size or dtype than the others (both kept);
- ``not_completed``: it entered the same collective and did not finish it, where the dump records
  completion (NCCL: ``state``); gloo records every entry as ``scheduled`` and nothing later, so on
  gloo a group whose members all entered is reported as entered, completion unknown;
- ``missing``: no dump from that rank (it died, or its dump was not written).  Gloo's dumps list no
  group members (``pg_config`` is empty), so a group's members are the ranks whose dumps name it,
  and a rank without a dump is counted in a group when it lies inside that group's ranks.

What cannot be known is said, not guessed: a buffer that wrapped past the sequence number compared
makes that rank's result partial; a dump that cannot be read is one error line.  Dumps are read with
an unpickler that refuses every class (they hold only dicts, lists, strings and numbers), so a
hostile file cannot run code.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfuscope import run_dir
from mfuscope.errors import UserInputError

from . import collectives

#: Where the collectors put each rank's dump in a run directory (collectors/flight_recorder.py).
FOLDER = "flight_recorder"
#: ...and their write-ahead records of every collective (collectors/collective_journal.py).
RECORDS = "collectives"
#: ...and each rank's Python stacks at a fatal signal (collectors/fatal_stacks.py).
FATAL = run_dir.FATAL
#: A dump's rank is the number its file name ends with (``nccl_trace_rank_3``, ``dump_rank_3.json``).
_RANK = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


@dataclass
class Entry:
    """One collective of one rank's dump."""

    pg: str
    desc: str
    seq: int
    op: str
    sizes: list
    dtypes: list
    state: str
    stack: list[str]
    step: int | None = None
    dim: str | None = None  # the collectors' records name it

    def signature(self) -> tuple:
        return (self.op, json.dumps(self.sizes), json.dumps(self.dtypes))


@dataclass
class Dump:
    rank: int
    file: Path
    entries: list[Entry]
    completion_recorded: bool  # the backend records completion (NCCL), not gloo's "scheduled" forever
    died: bool = False  # records but no Flight Recorder dump, where its peers wrote theirs
    fatal: dict[str, Any] | None = None  # it died of a fatal signal: :func:`read_fatal`'s entry


def read_dumps(path: str | Path) -> tuple[list[Dump], int | None]:
    """What every rank recorded of its collectives under ``path``: a run directory's write-ahead
    records (``collectives/``, from the collectors: they survive a rank killed by a signal and say
    when each call completed), else the Flight Recorder dumps in ``path`` (a directory, or one
    file), and the world size where the records say it.  A file that is not readable:
    UserInputError naming it."""
    path = Path(path)
    if (path / RECORDS).is_dir() and any((path / RECORDS).glob("rank*.jsonl")):
        return read_records(path)
    if (path / FOLDER).is_dir():  # a run directory: the dumps its ranks wrote when it ended early
        path = path / FOLDER
    files = sorted(f for f in path.iterdir() if f.is_file() and _RANK.search(f.name)) if path.is_dir() else [path]
    dumps: dict[int, Dump] = {}
    world = None
    for f in files:
        doc = _read(f)
        if doc is None:
            continue  # not a dump (a run directory's other files)
        m = _RANK.search(f.name)
        if m is None:
            raise UserInputError("no rank in the file name (Flight Recorder dumps end with it: ..._rank_3)", f)
        rank = int(m.group(1))
        if rank in dumps:
            if dumps[rank].file.suffix != ".json" and f.suffix == ".json":
                continue  # the same dump in both forms: the pickle is kept
            raise UserInputError(f"two dumps claim rank {rank}: {dumps[rank].file.name} and {f.name}", f)
        entries = [_entry(e, f) for e in doc.get("entries") or []]
        states = {e.state for e in entries}
        dumps[rank] = Dump(rank, f, entries, bool(states - {"scheduled"}))
        for cfg in (doc.get("pg_config") or {}).values():
            ranks = _ranks(cfg.get("ranks") if isinstance(cfg, dict) else None)
            if ranks:
                world = max(world or 0, max(ranks) + 1)
    if not dumps:
        raise UserInputError("no Flight Recorder dump here (files named ..._rank_N, pickled or JSON, with "
                             "'entries')", path)
    return [dumps[r] for r in sorted(dumps)], world


def read_records(run: Path) -> tuple[list[Dump], int | None]:
    """The collectors' write-ahead records of a run (collectors/collective_journal.py), as dumps."""
    dumps = []
    for f in sorted((run / RECORDS).glob("rank*.jsonl")):
        m = re.fullmatch(r"rank(\d+)\.jsonl", f.name)
        if m is None:
            continue
        calls: dict[tuple[str, int], Entry] = {}
        lines = f.read_bytes().splitlines()
        for n, line in enumerate(lines, 1):
            try:
                r = json.loads(line)
                key = (str(r["pg"]), int(r["seq"]) + 1)  # numbered from 1, as Flight Recorder does
                if r["e"] == "enq":
                    calls[key] = Entry(key[0], "", key[1], str(r["op"]), r.get("shapes") or [],
                                       [r["dtype"]] if r.get("dtype") else [], "scheduled", [], r.get("step"),
                                       r.get("dim"))
                elif r["e"] == "end" and key in calls:
                    calls[key].state = "completed"
            except (ValueError, KeyError, TypeError):
                if n == len(lines):
                    break  # the last line cut off by the rank's death: the ones before it stand
                raise UserInputError(f"line {n} is not a collective record", f) from None
        dumps.append(Dump(int(m.group(1)), f, list(calls.values()), True))
    stacks = _dump_stacks(run / FOLDER)
    fatal = read_fatal(run)
    for d in dumps:  # a session that ended early writes its dump; a rank that did not was killed
        d.died = (bool(stacks) and d.rank not in stacks) or d.rank in fatal
        d.fatal = fatal.get(d.rank)
        _give_stacks(d.entries, stacks.get(d.rank) or [])
    world = None
    try:
        manifest = run_dir.read_manifest(run)
        world = int(manifest.get("world_size") or 0) or None
    except (UserInputError, ValueError, TypeError):
        pass
    return dumps, world


#: faulthandler's names of the signals it handles, as their SIG names.
_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
            "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def read_fatal(run: str | Path) -> dict[int, dict[str, Any]]:
    """Each rank that died of a fatal signal, from what faulthandler wrote at it
    (``RUN/fatal/rank<N>.txt``, collectors/fatal_stacks.py): ``{"signal": "SIGSEGV", "error":
    faulthandler's words, "threads": [{"current": bool, "frames": ["file:line in function", ...]}]}``,
    frames innermost first.  An empty file (a rank killed by SIGKILL, or still running) is no entry."""
    out: dict[int, dict[str, Any]] = {}
    folder = Path(run) / FATAL
    if not folder.is_dir():
        return out
    for f in sorted(folder.glob("rank*.txt")):
        m = re.fullmatch(r"rank(\d+)\.txt", f.name)
        text = f.read_text(errors="replace") if m else ""
        if not text.strip():
            continue
        error = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Fatal Python error:")),
                     None)
        threads: list[dict[str, Any]] = []
        for line in text.splitlines():
            if line.startswith(("Current thread ", "Thread ")) and line.rstrip().endswith("(most recent call first):"):
                threads.append({"current": line.startswith("Current"), "frames": []})
            elif threads and (frame := _FRAME.match(line)):
                threads[-1]["frames"].append(f"{frame.group(1)}:{frame.group(2)} in {frame.group(3)}")
        out[int(m.group(1))] = {"signal": _SIGNALS.get(error or "", error), "error": error, "threads": threads,
                                "file": str(f)}
    return out


def fatal_frames(fatal: dict[str, Any]) -> list[str]:
    """The frames of the thread the signal hit, else (a thread with no Python frame: native code)
    of the first thread that has some (the training thread, usually)."""
    current = [t for t in fatal["threads"] if t["current"]]
    if current and current[0]["frames"]:
        return current[0]["frames"]
    return next((t["frames"] for t in fatal["threads"] if t["frames"]), [])


def _dump_stacks(folder: Path) -> dict[int, list[Entry]]:
    """The Flight Recorder entries of each rank that wrote a dump into a run's folder (best effort:
    they only lend their stacks to the records)."""
    out: dict[int, list[Entry]] = {}
    if not folder.is_dir():
        return out
    for f in sorted(folder.iterdir()):
        m = _RANK.search(f.name)
        if m is None or f.suffix == ".json":
            continue
        try:
            doc = _read(f)
            out[int(m.group(1))] = [_entry(e, f) for e in (doc or {}).get("entries") or []]
        except UserInputError:
            out[int(m.group(1))] = []  # written, if not readable: the rank did not die unseen
    return out


def _give_stacks(records: list[Entry], recorded: list[Entry]) -> None:
    """Each record the Python stack Flight Recorder kept for the same call: the k-th last call of a
    group and op in the records is the k-th last in the dump (their sequence numbers differ:
    Flight Recorder also counts calls the collectors do not wrap)."""
    by_key: dict[tuple[str, str], list[Entry]] = {}
    for e in sorted(recorded, key=lambda e: e.seq):
        by_key.setdefault((e.pg, _op(e)), []).append(e)
    mine: dict[tuple[str, str], list[Entry]] = {}
    for e in sorted(records, key=lambda e: e.seq):
        mine.setdefault((e.pg, _op(e)), []).append(e)
    for key, calls in mine.items():
        for rec, fr in zip(reversed(calls), reversed(by_key.get(key, []))):
            rec.stack = fr.stack


def _read(f: Path) -> dict[str, Any] | None:
    """A dump's document; None for a file that is plainly something else; error for a broken dump."""
    data = f.read_bytes()
    if not data:
        raise UserInputError("empty file (a dump cut off before it was written?)", f)
    if data[:1] in (b"{", b"["):
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise UserInputError(f"not a readable Flight Recorder dump: invalid JSON ({e})", f) from None
    elif data[:1] == b"\x80":  # pickle protocol 2+
        try:
            doc = _SafeUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise UserInputError(f"not a readable Flight Recorder dump: {e or 'truncated pickle'}", f) from None
    else:
        return None
    if not isinstance(doc, dict) or "entries" not in doc:
        raise UserInputError("not a Flight Recorder dump: no 'entries'", f)
    return doc


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a dump holds plain data only")


def _entry(e: dict, f: Path) -> Entry:
    try:
        pg = e.get("process_group") or ["", ""]
        frames = e.get("frames") or []
        stack = [f"{fr.get('filename')}:{fr.get('line')} {fr.get('name')}" for fr in frames[:8] if isinstance(fr, dict)]
        return Entry(str(pg[0]), str(pg[1]) if len(pg) > 1 else "", int(e["collective_seq_id"]),
                     str(e.get("profiling_name") or "?"), e.get("input_sizes") or [], e.get("input_dtypes") or [],
                     str(e.get("state") or "scheduled"), stack)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise UserInputError(f"a Flight Recorder entry without its group or sequence number ({err})", f) from None


def _ranks(text: Any) -> list[int]:
    if isinstance(text, list):
        return [int(r) for r in text]
    if isinstance(text, str):
        try:
            parsed = json.loads(text)
        except ValueError:
            return []
        return [int(r) for r in parsed] if isinstance(parsed, list) else []
    return []


def run_group_dims(path: str | Path) -> dict[str, str]:
    """Group name -> parallel dimension, as the collectors recorded them in a run directory's
    manifest (Flight Recorder names a group only by its number and description)."""
    try:
        manifest = run_dir.read_manifest(path) if run_dir.is_run_dir(path) else None
    except UserInputError:
        return {}
    return {str(g["name"]): g["dim"] for g in (manifest or {}).get("process_groups") or []
            if g.get("name") is not None and g.get("dim")}


def diagnose(dumps: list[Dump], world: int | None = None, dims: dict[str, str] | None = None) -> dict[str, Any]:
    """Per process group, where it stopped and who is to blame (see the module docstring);
    ``dims``: group name -> dimension where the run recorded it (:func:`run_group_dims`)."""
    world = max(world or 0, max(d.rank for d in dumps) + 1)
    present = {d.rank for d in dumps}
    missing = sorted(set(range(world)) - present)
    by_group: dict[str, dict[int, dict[int, Entry]]] = {}
    descs: dict[str, str] = {}
    dims = dict(dims or {})
    for d in dumps:
        for e in d.entries:
            if e.seq <= 0 or e.op.endswith(("send", "recv")):
                continue  # point-to-point calls are numbered apart (p2p_seq_id)
            by_group.setdefault(e.pg, {}).setdefault(d.rank, {})[e.seq] = e
            descs[e.pg] = descs.get(e.pg) or e.desc
            if e.dim and e.pg not in dims:
                dims[e.pg] = e.dim
    died = {d.rank for d in dumps if d.died}
    completion = {d.rank: d.completion_recorded for d in dumps}
    groups = [_group(pg, ranks, descs.get(pg, ""), missing, completion, dims.get(pg))
              for pg, ranks in sorted(by_group.items())]
    fatal = {d.rank: d.fatal for d in dumps if d.fatal}
    for g in groups:
        for c in g.get("culprits") or []:
            if c["rank"] in died:
                c["died"] = True
            if c["rank"] in fatal:
                c["fatal"] = fatal[c["rank"]]["signal"]
    groups.sort(key=lambda g: (g["state"] == "ok", g["seq"] if g["seq"] is not None else 0))
    return {"ranks": sorted(present), "world_size": world, "missing": missing, "groups": groups,
            "fatal": fatal, "files": {d.rank: str(d.file) for d in dumps}}


def _group(pg: str, ranks: dict[int, dict[int, Entry]], desc: str, missing: list[int],
           completion: dict[int, bool], dim: str | None) -> dict[str, Any]:
    members = sorted(ranks)
    first_seen = {r: min(ranks[r]) for r in members}
    last_seen = {r: max(ranks[r]) for r in members}
    top = max(last_seen.values())
    start = max(first_seen.values())  # below it some buffer has wrapped: nothing to compare there
    stop = None
    for seq in range(start, top + 1):
        entered = {r: ranks[r].get(seq) for r in members}
        if any(e is None for e in entered.values()) or len({e.signature() for e in entered.values() if e}) > 1:
            stop = seq
            break
    out: dict[str, Any] = {"pg": pg, "desc": desc, "dim": dim or collectives.group_dim(pg, desc), "members": members,
                           "compared_from_seq": start, "last_seq": top}
    lost = [r for r in missing if members[0] < r < members[-1]]  # in the group as far as can be told
    if stop is None:
        done = [r for r in members if completion.get(r)]
        unfinished = [r for r in done if ranks[r][top].state != "completed"]
        out.update(seq=top, op=_op(ranks[members[0]][top]))
        if lost:  # the others got as far as their last collective: the rank without a dump is the story
            out.update(state="hung", entered=members, culprits=[_missing(r) for r in lost])
        elif unfinished:
            out.update(state="hung", culprits=[_culprit(r, "not_completed", ranks[r], top) for r in unfinished])
        elif len(done) < len(members):
            out.update(state="entered", note=f"every member entered #{top}, the group's last; whether it completed "
                       "is not recorded by this backend (gloo)", culprits=[])
        else:
            out.update(state="ok", culprits=[])
        return out
    entered = {r: ranks[r].get(stop) for r in members}
    votes: dict[tuple, list[int]] = {}
    for r, e in entered.items():
        if e is not None:
            votes.setdefault(e.signature(), []).append(r)
    expected_sig = max(votes, key=lambda k: (len(votes[k]), -min(votes[k]))) if votes else None
    expected = next((entered[r] for r in votes.get(expected_sig, [])), None)
    culprits = []
    for r in members:
        e = entered[r]
        if e is None:
            culprits.append(_culprit(r, "never_entered", ranks[r], stop))
        elif e.signature() != expected_sig:
            c = _culprit(r, "desync", ranks[r], stop)
            c["got"] = _what(e)
            c["expected"] = _what(expected)
            c["expected_from"] = votes[expected_sig]
            culprits.append(c)
    culprits += [_missing(r) for r in lost]
    out.update(state="hung", seq=stop, op=_op(expected) if expected else None, culprits=culprits,
               entered=sorted(votes.get(expected_sig, [])))
    return out


def _missing(rank: int) -> dict[str, Any]:
    return {"rank": rank, "class": "missing", "detail": "no Flight Recorder dump from this rank"}


def _culprit(rank: int, cls: str, mine: dict[int, Entry], seq: int) -> dict[str, Any]:
    before = [s for s in mine if s < seq]
    last = mine[max(before)] if before else None
    out: dict[str, Any] = {"rank": rank, "class": cls}
    if last is not None:
        out["last_entered"] = {"seq": last.seq, "op": _op(last), "step": last.step, "state": last.state,
                               **_what(last)}
        out["stack"] = last.stack
    if cls != "never_entered" and seq in mine:
        out["stack"] = mine[seq].stack
        out["step"] = mine[seq].step
    return out


def _op(e: Entry) -> str:
    return collectives.normalize_op(e.op) or e.op


def _what(e: Entry) -> dict[str, Any]:
    return {"op": _op(e), "sizes": e.sizes, "dtypes": e.dtypes}


def format_text(result: dict[str, Any]) -> str:
    """What to look at first, then every group."""
    lines = []
    hung = [g for g in result["groups"] if g["state"] == "hung"]
    # A crash is the story -- unless a desync explains it: gloo and NCCL abort a rank that receives
    # a size it did not expect, so there the desync comes first and the abort after it.
    desynced = any(c["class"] == "desync" for g in hung for c in g["culprits"])
    crashes = _fatal_lines(result.get("fatal") or {}, desynced)
    if not desynced:
        lines += crashes
    if len(result["ranks"]) == 1:
        lines.append(f"one rank's dump ({result['ranks'][0]}): a hang is read across ranks, so there is nothing to "
                     "compare it with; give the directory of every rank's dump")
    if result["missing"]:
        lines.append(f"no dump from rank(s) {', '.join(map(str, result['missing']))}: died, or never wrote one")
    if not hung:
        lines.append("no group is stuck in these dumps: every member of every group got through the same "
                     "collectives" + (" (gloo does not record completion: see below)"
                                      if any(g["state"] == "entered" for g in result["groups"]) else ""))
    for g in hung:
        head = f"{_group_name(g)}: stuck at {g['op']} #{g['seq']}"
        lines.append(head)
        for c in g["culprits"]:
            lines.append("  " + _culprit_text(c, g))
    if desynced:
        lines += crashes
    for g in result["groups"]:
        if g["state"] != "hung":
            lines.append(f"{_group_name(g)}: {g['state']} through #{g['last_seq']}"
                         + (f" -- {g['note']}" if g.get("note") else ""))
    return "\n".join(lines)


#: How many frames of a crashed rank's stack the text shows (the file has them all).
FATAL_FRAMES = 6


def _fatal_lines(fatal: dict[int, dict[str, Any]], after_desync: bool) -> list[str]:
    lines = []
    for rank, f in sorted(fatal.items()):
        frames = fatal_frames(f)
        where = f" in {_user_frame(frames)}" if frames else " in a thread with no Python frame"
        why = ("most likely the desync above (a rank that receives a size it did not expect is aborted)"
               if after_desync and f["signal"] == "SIGABRT" else "a crash in native code or an abort, not a hang")
        lines.append(f"rank {rank} died of {f['signal']} ({f['error']}){where}: {why}; "
                     f"its threads' Python stacks: {f['file']}")
        lines += [f"    {frame}" for frame in frames[:FATAL_FRAMES]]
    return lines


def _group_name(g: dict[str, Any]) -> str:
    desc = f' "{g["desc"]}"' if g["desc"] and g["desc"] != g["pg"] else ""
    return f"group {g['pg']}{desc} ({g['dim'] or 'dimension unknown'}, ranks {_span(g['members'])})"


#: mfuscope's own collectors wrap the collectives: their frames are not the caller's either.
_COLLECTORS = str(Path(__file__).resolve().parent.parent / "collectors") + "/"


def _user_frame(stack: list[str]) -> str | None:
    """The first frame outside torch and mfuscope's collectors: the caller's line, not c10d's."""
    def outside(frame: str) -> bool:
        file = frame.split(" ")[0]
        return "/torch/" not in file and not file.startswith(_COLLECTORS)
    return next((f for f in stack if outside(f)), stack[0] if stack else None)


def _culprit_text(c: dict[str, Any], g: dict[str, Any]) -> str:
    last = c.get("last_entered")
    at_step = f" (step {last['step']})" if last and last.get("step") is not None else ""
    after = f"; its last: {last['op']} #{last['seq']}{at_step}" if last else ""
    frame = _user_frame(c.get("stack") or [])
    where = f", called at {frame}" if frame else ""
    if c["class"] == "never_entered":
        died = (f" (it died of {c['fatal']}: above)" if c.get("fatal") else
                " (it died: no Flight Recorder dump, where its peers wrote theirs)" if c.get("died") else "")
        return f"rank {c['rank']} never entered it{died}{after}{where}"
    if c["class"] == "desync":
        step = f" in step {c['step']}" if c.get("step") is not None else ""
        return (f"rank {c['rank']} desynced{step}: entered #{g['seq']} as {c['got']['op']} {c['got']['sizes']} "
                f"{c['got']['dtypes']} where ranks {_span(c['expected_from'])} entered {c['expected']['op']} "
                f"{c['expected']['sizes']} {c['expected']['dtypes']}{where}")
    if c["class"] == "not_completed":
        return f"rank {c['rank']} entered it and never completed it (a peer or the link){where}"
    return f"rank {c['rank']}: {c.get('detail', c['class'])}"


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
