"""kllm_plugins.bench.stats: numpy.percentile-compatible quantiles, spread, ratio of medians."""
import random

import numpy as np
import pytest

from kllm_plugins.bench.stats import distribution, percentile, quantile, ratio_of_medians, spread


@pytest.mark.parametrize("n", [1, 2, 7, 72, 501])
def test_quantile_equals_numpy_percentile(n):
    rng = random.Random(n)
    xs = [rng.lognormvariate(0, 1) for _ in range(n)]
    for q in (0.0, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0):
        assert quantile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)), rel=1e-12)
        assert percentile(xs, 100 * q) == pytest.approx(float(np.percentile(xs, 100 * q)), rel=1e-12)


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match="outside"):
        quantile([1.0], 99)
    with pytest.raises(ValueError, match="NaN"):
        quantile([1.0, float("nan")], 0.5)


def test_distribution_and_spread():
    d = distribution([1, 2, 3, 4])
    assert d["mean"] == 2.5 and d["p50"] == 2.5 and d["min"] == 1 and d["max"] == 4 and d["n"] == 4
    s = spread([3.0, 1.0, 2.0])
    assert s["median"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0 and s["repeats"] == [3.0, 1.0, 2.0]


def test_ratio_of_medians_paired_and_unpaired():
    r = ratio_of_medians([2.0, 4.0, 6.0], [1.0, 2.0, 4.0])
    assert r["paired"] and r["ratio"] == pytest.approx(2.0)
    assert (r["min"], r["max"]) == (pytest.approx(1.5), pytest.approx(2.0))
    u = ratio_of_medians([2.0, 4.0], [1.0, 2.0, 4.0])
    assert not u["paired"] and u["ratio"] == pytest.approx(1.5)
    assert (u["min"], u["max"]) == (pytest.approx(0.5), pytest.approx(4.0))
    with pytest.raises(ValueError, match="median is 0"):
        ratio_of_medians([1.0], [0.0])
