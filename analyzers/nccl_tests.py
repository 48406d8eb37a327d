"""nccl-tests' text output as the yardstick for a job's collectives (``mfuscope analyze --nccl-tests FILE``).

nccl-tests (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``, ``alltoall_perf``,
``sendrecv_perf``, ``broadcast_perf``) print one table per run: a header naming the columns (size,
count, type, redop, root, then time, algbw, busbw and #wrong for out-of-place and again for
in-place), then one row per message size.  Old and new versions alike keep the two
time/algbw/busbw/error blocks at the right end of the row, so the bus bandwidths are read from the
right, at the places the header gives them; what comes before them varies (no ``root`` before
2.10, a blank ``redop`` for all-to-all, ``N/A`` or ``0e+00`` errors).

Which test a table is: the ``# Collective test starting: all_reduce_perf`` line (nccl-tests 2.17
and later, one per test in a file that holds several), else the ``*_perf`` binary the file names
(a command line), else the file's name (``alltoall_8nodes.txt``).  How many ranks ran it: its
``#  Rank N ...`` lines.  A size's reference is the better of the out-of-place and in-place bus
bandwidths (what the links delivered at that size).

:func:`compare` puts a communication row beside the table of its operation (the one with as many
ranks as the row's group when there is one): its median call size is placed between the table's
two nearest sizes and the bus bandwidth interpolated in log-size; above the largest size the
largest size's figure holds (bandwidth has levelled off by then), below the smallest there is no
reference.  The row gets ``nccl_tests_busbw_gbps``, ``busbw_of_nccl_tests`` and ``nccl_tests_file``.
The sizes are compared as the calls carry them (the collectors record nccl-tests' own size for
every op: an all-gather's output, a reduce-scatter's input).
"""
from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfuscope.errors import UserInputError

#: nccl-tests binary (without ``_perf``) -> our operation name.
TESTS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
         "alltoall": "all_to_all", "sendrecv": "send_recv", "broadcast": "broadcast", "reduce": "reduce",
         "gather": "gather", "scatter": "scatter", "hypercube": "hypercube"}
#: Operations of our rows that a test measures: point-to-point rows against sendrecv_perf.
_ROW_OP = {"send": "send_recv", "recv": "send_recv"}
_BINARY = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(sorted(TESTS, key=len, reverse=True)) + r")_perf")
_STARTING = re.compile(r"^\W*Collective test starting:\s*(\S+)", re.M)
#: In a file name: letters only (``all-reduce``, ``all_reduce``, ``allreduce``).  Longest first.
_NAME_TOKENS = (("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
                ("alltoall", "all_to_all"), ("sendrecv", "send_recv"), ("broadcast", "broadcast"))
#: A launcher's label before a line: ``[1,0]<stdout>:`` (Open MPI), ``0:`` (srun -l), ``[0]``.
_PREFIX = re.compile(r"^\s*(?:\[\d+(?:,\d+)*\](?:<\w+>)?:?|\d+:(?=\s))\s*")
_RANK_LINE = re.compile(r"^#\s*Rank\s+\d+\s.*$", re.M)
_EXPECTED = ("expected the output of an nccl-tests binary (all_reduce_perf and the like): a "
             "'#  size  count  type ... time  algbw  busbw ...' header and a row per size below it")


@dataclass(frozen=True)
class Table:
    """One nccl-tests run: bus bandwidth (GB/s) by message size (bytes, ascending)."""

    path: str
    test: str  # the binary, e.g. all_reduce_perf
    op: str  # our name for what it measures
    ranks: int | None
    sizes: tuple[int, ...]
    busbw_gbps: tuple[float, ...]

    def busbw_at(self, nbytes: float) -> float | None:
        """The bus bandwidth at ``nbytes``, interpolated linearly in log-size between the two nearest
        sizes; the largest size's above it, None below the smallest."""
        if not self.sizes or nbytes is None or nbytes < self.sizes[0]:
            return None
        i = bisect.bisect_right(self.sizes, nbytes) - 1
        if i >= len(self.sizes) - 1:
            return self.busbw_gbps[-1]
        lo, hi = self.sizes[i], self.sizes[i + 1]
        t = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return self.busbw_gbps[i] + t * (self.busbw_gbps[i + 1] - self.busbw_gbps[i])


def read(path: str | os.PathLike) -> list[Table]:
    """The tables of one nccl-tests output file; :class:`UserInputError` naming the file when it has
    none or does not say which test it is."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise UserInputError(f"cannot read this nccl-tests output: {e.strerror or e}", path) from None
    starts = list(_STARTING.finditer(text))
    if starts:
        sections = [(m.group(1), text[m.start():nxt.start() if nxt else len(text)])
                    for m, nxt in zip(starts, starts[1:] + [None])]
    else:
        sections = [(_test_named(text, path), text)]
    tables = []
    for test, body in sections:
        sizes, busbw = _rows(body)
        if not sizes:
            continue
        key = re.sub(r"_perf(_mpi)?$", "", test)
        if key not in TESTS:
            raise UserInputError(f"'{test}' is not an nccl-tests binary this reads ({', '.join(TESTS)})", path)
        ranks = len(set(line.strip() for line in _RANK_LINE.findall(body))) or None
        tables.append(Table(str(path), f"{key}_perf", TESTS[key], ranks, tuple(sizes), tuple(busbw)))
    if not tables:
        raise UserInputError(f"no nccl-tests result table in it: {_EXPECTED}", path)
    return tables


def read_all(paths: Iterable[str | os.PathLike]) -> list[Table]:
    return [t for p in paths for t in read(p)]


def _test_named(text: str, path: Path) -> str:
    """The test of a file without ``Collective test starting`` lines: the one ``*_perf`` binary it
    names, else the one its file name names."""
    named = sorted({m.group(1) for m in _BINARY.finditer(text)})
    if len(named) == 1:
        return f"{named[0]}_perf"
    if len(named) > 1:
        raise UserInputError(f"names several nccl-tests binaries ({', '.join(n + '_perf' for n in named)}) and no "
                             "'# Collective test starting:' line tells their tables apart; give each its own file",
                             path)
    letters = re.sub(r"[^a-z]", "", path.name.lower())
    for token, op in _NAME_TOKENS:
        if token in letters:
            return next(k for k, v in TESTS.items() if v == op) + "_perf"
    raise UserInputError("cannot tell which collective it measured: no '# Collective test starting:' line, no "
                         "*_perf command in it, and its name names none (call it e.g. all_reduce_perf.txt)", path)


def _rows(body: str) -> tuple[list[int], list[float]]:
    """Sizes and the better bus bandwidth of each, from the rows under a header."""
    offsets: list[int] | None = None
    best: dict[int, float] = {}
    for raw in body.splitlines():
        line = _PREFIX.sub("", raw)
        tokens = line.lstrip("#").split()
        if "size" in tokens and "busbw" in tokens:
            offsets = [len(tokens) - i for i, t in enumerate(tokens) if t == "busbw"]
            continue
        if offsets is None or line.startswith("#") or len(tokens) < max(offsets) + 2:
            continue
        if not (tokens[0].isdigit() and tokens[1].isdigit()):
            continue
        try:
            values = [float(tokens[-k]) for k in offsets]
        except ValueError:
            continue
        size = int(tokens[0])
        if size > 0 and all(math.isfinite(v) for v in values):
            best[size] = max(best.get(size, 0.0), *values)
    sizes = sorted(best)
    return sizes, [best[s] for s in sizes]


def compare(rows: list[dict[str, Any]], tables: list[Table]) -> None:
    """Adds to each communication row its reference from ``tables`` (see the module's docstring):
    ``nccl_tests_busbw_gbps``, ``busbw_of_nccl_tests`` (the row's bus bandwidth over it),
    ``nccl_tests_file``, ``nccl_tests_test``, ``nccl_tests_ranks``; None where no table measures the
    row's operation at its size, or the row has no bandwidth."""
    for row in rows:
        row.update({"nccl_tests_busbw_gbps": None, "busbw_of_nccl_tests": None, "nccl_tests_file": None,
                    "nccl_tests_test": None, "nccl_tests_ranks": None})
        table = _table_for(row, tables)
        if table is None or row.get("busbw_gbps") is None or not row.get("median_bytes"):
            continue
        ref = table.busbw_at(row["median_bytes"])
        if not ref:
            continue
        row.update({"nccl_tests_busbw_gbps": ref, "busbw_of_nccl_tests": row["busbw_gbps"] / ref,
                    "nccl_tests_file": table.path, "nccl_tests_test": table.test, "nccl_tests_ranks": table.ranks})


def _table_for(row: dict[str, Any], tables: list[Table]) -> Table | None:
    """The table of the row's operation run on as many ranks as the row's group, else one whose
    ranks are not known, else the nearest in ranks; the first given on a tie."""
    op = _ROW_OP.get(row.get("op"), row.get("op"))
    mine = [t for t in tables if t.op == op]
    if not mine:
        return None
    n = row.get("group_size") or 0
    return min(mine, key=lambda t: (0, 0) if t.ranks == n else (1, 0) if t.ranks is None else (2, abs(t.ranks - n)))
