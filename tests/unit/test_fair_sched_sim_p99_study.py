"""What the simulated P99 study's figures rest on: the 3-seed resampling, the age_weight frontier,
and the docs table being the one built from the recorded summary."""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import pytest

from kllm_plugins.bench.record import load_summary, result_path


def test_three_seed_subsets_pair_seeds_and_count_strict_misses(bench_module: Callable[[str, str], ModuleType]) -> None:
    st = bench_module("fair_sched", "sim_p99_study")
    # Seed 3 is a bad seed for ours: the 3 subsets holding it miss (2.0), the one without it ties (1.0).
    assert sorted(st.subset_ratios([1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, 1.0])) == [1.0, 2.0, 2.0, 2.0]
    s = st.noise_stats([1.0, 1.0, 1.0, 4.0], [1.0, 1.0, 1.0, 1.0])
    assert s["miss_3seed"] == 0.75 and s["seeds_0_2"] == 1.0 and s["median"] == 1.0
    assert s["ratio_of_means"] == pytest.approx(7 / 4)
    # Ratio of means over the subset, not mean of per-seed ratios: 2/1 and 1/4 pair to 3/5.
    assert st.subset_ratios([2.0, 1.0], [1.0, 4.0], k=2) == [pytest.approx(0.6)]
    with pytest.raises(ValueError, match="paired"):
        st.subset_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


def test_frontier_takes_the_lowest_p99_among_settings_that_hold_the_mean(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    st = bench_module("fair_sched", "sim_p99_study")
    row = {"0": [3.0, 0.5, 1.0], "8": [0.9, 0.95, 1.2], "32": [1.0, 0.9, 1.4], "1e+06": [1.01, 0.8, 1.5]}
    assert st.best_feasible(row) == {"min_mean": 0.9, "age_weight": "32", "p99": 0.9, "tpot": 1.4}
    assert st.best_feasible({"0": [1.2, 0.5, 1.0]})["age_weight"] is None


def test_doc_table_is_current(bench_module: Callable[[str, str], ModuleType]) -> None:
    st = bench_module("fair_sched", "sim_p99_study")
    text = st.DOC.read_text(encoding="utf-8")
    assert st.render(text, load_summary(result_path("fair_sched", "sim_p99_study"))) == text, (
        "run: python benchmarks/fair_sched/sim_p99_study.py --write-doc")
