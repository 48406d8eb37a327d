"""Sums and counts per group of a rank's few rows, in numpy: what ``groupby(keys).agg(...)`` gives.

A rank's analyses group frames of a handful of rows (its calls per step, its call names' time).
pandas' groupby costs milliseconds a call whatever the rows (a named aggregation of 3 rows: ~10
ms), which made it most of a small rank's map.  :func:`grouped` sorts the rows by their keys once
and adds each column over the runs of equal keys (``np.add.reduceat``): the groups, their order
and the dtypes of ``frame.groupby(keys, sort=True, dropna=dropna).agg(**aggs).reset_index()``
with ``sum``, ``count`` and ``size`` -- the same arithmetic at every size (floats are added in
row order, where pandas adds with a compensated sum: equal to the last bits).

Keys are plain columns (numbers, strings), not categoricals: pandas groups those by their
categories, which this does not mimic.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

#: The aggregations :func:`grouped` knows, as pandas names them.
AGGS = ("sum", "count", "size")


def grouped(columns: Mapping[str, pd.Series], keys: list[str], dropna: bool = True, as_index: bool = False,
            **aggs: tuple[str, str]) -> pd.DataFrame:
    """``pd.DataFrame(columns).groupby(keys, dropna=dropna).agg(**aggs).reset_index()``.

    ``columns``: equal-length Series (or a frame) holding the keys and the aggregated columns;
    ``aggs``: output name -> (column, one of :data:`AGGS`).  A key that is missing (NaN, None)
    drops its row, or with ``dropna=False`` is a group of its own, sorted last.  ``as_index``
    (one key): the key as the frame's index, as without ``reset_index()``."""
    n = len(columns[keys[0]])
    factors = {k: pd.factorize(columns[k].to_numpy(), sort=True, use_na_sentinel=dropna) for k in keys}
    codes = [factors[k][0] for k in keys]
    rows = np.arange(n)
    if dropna and n:
        rows = rows[np.logical_and.reduce([c >= 0 for c in codes])]
    order = rows[np.lexsort([c[rows] for c in reversed(codes)])] if len(rows) else rows
    if len(order):
        changed = np.zeros(len(order), dtype=bool)
        changed[0] = True
        for c in codes:
            changed[1:] |= c[order][1:] != c[order][:-1]
        starts = np.flatnonzero(changed)
    else:
        starts = np.empty(0, dtype=np.intp)
    first = order[starts]
    out = {k: _key(columns[k], *factors[k], first) for k in keys}
    sums = {name: _reduce(columns[column], how, order, starts) for name, (column, how) in aggs.items()}
    if as_index:
        (key,) = keys
        return pd.DataFrame(sums, index=pd.Index(out[key], name=key))
    out.update(sums)
    return pd.DataFrame(out)  # of arrays, not Series: no index to align (5x cheaper)


def _key(column: pd.Series, codes: np.ndarray, uniques, first: np.ndarray):
    """The key of each group, as pandas gives it: in the column's dtype, except that an object
    column's distinct values are inferred again (strings become ``str`` where pandas infers
    strings, even when no group is left), and a missing key's group is named NaN."""
    if column.dtype != object:
        return column.to_numpy()[first] if isinstance(column.dtype, np.dtype) else column.array.take(first)
    values = np.asarray(uniques, dtype=object)
    values[pd.isna(values)] = np.nan
    return pd.Index(values.tolist()).take(codes[first])


def _reduce(column: pd.Series, how: str, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``column`` reduced over each run of ``order`` that begins at ``starts`` (NaN skipped)."""
    if how == "size":
        return np.diff(np.append(starts, len(order))).astype(np.int64)
    values = column.to_numpy()[order]
    missing = pd.isna(values)
    if how == "count":
        summed, dtype = (~missing).astype(np.int64), np.int64
    elif how == "sum":
        dtype = {"i": np.int64, "b": np.int64, "u": np.uint64}.get(values.dtype.kind, np.float64)
        summed = np.where(missing, 0, values).astype(dtype)
    else:
        raise ValueError(f"unknown aggregation {how!r} (one of {', '.join(AGGS)})")
    return np.add.reduceat(summed, starts) if len(starts) else np.empty(0, dtype=dtype)


def as_str(column: pd.Series) -> pd.Series:
    """``column.astype(str)``, without its cost on a categorical.  pandas turns a categorical's rows
    into fixed-width numpy strings as wide as its longest value on the way (measured: 200,000 rows
    with one 600-character kernel name, 908 MB for a moment; a map worker peaked at 9x its trace).
    Here each category is turned into ``str`` once and the rows take theirs; a missing value comes
    out as ``astype(str)`` gives it in the pandas mode at hand (``"nan"``, or missing where pandas
    infers its ``str`` dtype)."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        return column.astype(str)
    values = np.array([str(c) for c in column.cat.categories] + [np.nan], dtype=object)
    return pd.Series(values[column.cat.codes.to_numpy()], index=column.index).astype(str)
