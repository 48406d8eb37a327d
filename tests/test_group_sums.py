"""group_sums.grouped is pandas' groupby-agg: the same groups, order, dtypes and sums."""
import contextlib
import tracemalloc
import warnings

import numpy as np
import pandas as pd
import pytest

from mfuscope.analyzers.group_sums import as_str, grouped

AGGS = {"size": ("val", "size"), "s": ("val", "sum"), "c": ("val", "count"), "i": ("ival", "sum")}


def _frame(rng, n: int, missing_keys: bool, as_str: bool) -> pd.DataFrame:
    dims = pd.Series(list(rng.choice(["dp", "tp", "pp", None] if missing_keys else ["dp", "tp", "pp"], n)),
                     dtype=object)
    return pd.DataFrame({"dim": dims.astype(str) if as_str else dims,
                         "step": rng.integers(0, 3, n).astype(np.int32),
                         "val": np.where(rng.random(n) < 0.3, np.nan, rng.random(n) * 1e6),
                         "ival": rng.integers(0, 10**12, n),
                         "fkey": np.where(rng.random(n) < 0.3, np.nan, rng.integers(0, 3, n).astype(float))})


@pytest.mark.parametrize("keys", [["dim", "step"], ["step"], ["dim"], ["dim", "fkey"], ["fkey", "step"]])
@pytest.mark.parametrize("dropna", [True, False])
def test_grouped_is_pandas_groupby(keys, dropna):
    rng = np.random.default_rng(0)
    for trial in range(60):
        df = _frame(rng, int(rng.integers(0, 12)), trial % 3 == 0, bool(trial % 2))
        expected = df.groupby(keys, dropna=dropna).agg(**AGGS).reset_index()
        got = grouped(df, keys, dropna=dropna, **AGGS)
        # float sums: added in row order here, with a compensated sum by pandas (equal to the last bits)
        pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-13)
        exact = [c for c in got if c != "s"]
        pd.testing.assert_frame_equal(got[exact], expected[exact], check_exact=True)


def test_grouped_as_index_is_groupby_without_reset_index():
    rng = np.random.default_rng(1)
    df = _frame(rng, 9, missing_keys=False, as_str=True)
    expected = df.groupby(df["dim"])["ival"].agg(["count", "sum"])
    got = grouped(df, ["dim"], as_index=True, count=("ival", "count"), sum=("ival", "sum"))
    pd.testing.assert_frame_equal(got, expected, check_column_type=False)


@pytest.mark.parametrize("infer_string", [True, False])
def test_as_str_is_astype_str_on_categoricals_and_plain_columns(infer_string):
    """In both of pandas' string modes (the map's tasks run with object strings: map_reduce)."""
    values = ["aten::mm", None, "ncclDevKernel_AllReduce", "aten::mm", "x" * 300]
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        try:
            stack.enter_context(pd.option_context("future.infer_string", infer_string))
        except (KeyError, pd.errors.OptionError):
            pytest.skip("this pandas has one string mode")
        for column in (pd.Series(values, dtype="category"), pd.Series(values, dtype=object)):
            expected = column.astype(str)
            assert pd.isna(as_str(column)).tolist() == pd.isna(expected).tolist()
            assert as_str(column).fillna("-").tolist() == expected.fillna("-").tolist()
            assert as_str(column).index.equals(column.index)


def test_as_str_does_not_widen_every_row_to_the_longest_name():
    """Real kernel names run to thousands of characters (templated CUTLASS kernels).  pandas'
    categorical astype(str) goes through fixed-width strings of the longest: 50,000 rows and one
    2,000-character name are 50,000 x 2,000 x 4 bytes = 400 MB.  as_str turns each category once:
    the rows' object array (0.4 MB) and the strings it shares."""
    column = pd.Series(["aten::mm"] * 50_000 + ["k" * 2_000], dtype="category")
    tracemalloc.start()
    try:
        out = as_str(column)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.iloc[-1] == "k" * 2_000 and out.iloc[0] == "aten::mm"
    assert peak < 0.05 * len(column) * 2_000 * 4, peak  # under 20 MB of the 400 MB
