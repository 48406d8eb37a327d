"""group_sums.grouped is pandas' groupby-agg: the same groups, order, dtypes and sums."""
import numpy as np
import pandas as pd
import pytest

from mfuscope.analyzers.group_sums import grouped

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
