"""Mergeable histograms of durations, for medians over thousands of ranks read apart.

A duration d > 0 falls in bucket ``ceil(log(d) / log(GAMMA))`` with ``GAMMA = (1 + a) / (1 - a)``;
every duration of a bucket is within a relative ``a`` (:data:`RELATIVE_ERROR`) of the bucket's
representative ``2 GAMMA^i / (GAMMA + 1)`` (DDSketch's bounds: Masson, Rim and Lee, VLDB 2019).
Histograms of ranks add bucket by bucket, so the median of all ranks' kernels needs no rank's
durations, and its error stays ``a`` whatever the number of ranks.  Zero durations get a bucket
of their own (:data:`ZERO`), whose value is 0.
"""
from __future__ import annotations

import numpy as np

RELATIVE_ERROR = 0.005
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
ZERO = np.iinfo(np.int32).min  # the bucket of zero (and negative) durations


def buckets(durations: np.ndarray) -> np.ndarray:
    """The bucket of each duration (int32)."""
    d = np.asarray(durations, dtype=np.float64)
    out = np.full(d.shape, ZERO, dtype=np.int32)
    positive = d > 0
    out[positive] = np.ceil(np.log(d[positive]) / np.log(GAMMA)).astype(np.int32)
    return out


def value(bucket: int) -> float:
    """The representative duration of a bucket (within :data:`RELATIVE_ERROR` of any in it)."""
    return 0.0 if bucket == ZERO else 2.0 * GAMMA ** bucket / (GAMMA + 1.0)


def weighted_median(values: np.ndarray, counts: np.ndarray) -> float:
    """The median of values held as (value, how many): numpy's (the mean of the two middle ones)."""
    order = np.argsort(values, kind="stable")
    v, cum = np.asarray(values, dtype=float)[order], np.cumsum(np.asarray(counts)[order])
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        return float("nan")
    lo, hi = (total - 1) // 2, total // 2  # 0-based ranks of the middle value(s)
    return float((v[np.searchsorted(cum, lo + 1)] + v[np.searchsorted(cum, hi + 1)]) / 2)


def median(bucket_ids: np.ndarray, counts: np.ndarray) -> float:
    """The median of the durations a histogram holds (the mean of the two middle ones for an even
    count, as numpy's), each middle one within :data:`RELATIVE_ERROR`."""
    ids = np.asarray(bucket_ids)
    return weighted_median(np.array([value(int(b)) for b in ids]), counts)
