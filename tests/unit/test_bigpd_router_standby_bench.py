"""The standby benchmarks' violation-window measures (what their recorded figures rest on)."""
from __future__ import annotations

from types import ModuleType
from typing import Callable


def test_real_bench_window_counts_bins_under_the_slo_and_when_the_last_ends(bench_module: Callable[[str, str], ModuleType]) -> None:
    real = bench_module("bigpd_router", "bench_scaling_standby_real")
    step = 100.0
    log = []
    for k in range(20):  # 20 s of step, 5 s bins: bins 0 and 2 slow, 1 and 3 fast
        t = step + k + 0.5
        slow = k < 5 or 10 <= k < 15
        log.append((t, 200, 1.5 if slow else 0.2, "http://a", 1))
    log.append((step - 1, 200, 5.0, "http://a", 0))  # before the step: not counted
    log.append((step + 16, 503, None, "http://a", 1))  # a failed request is a miss: bin 3 at 5 of 6, under 0.9
    out = real.violation(log, step, step + 20, target=1.0, bin_s=5.0, bin_slo=0.9)
    assert out["violation_window_s"] == 15.0
    assert out["recovered_after_s"] == 20.0
    assert out["bins_attainment"] == [0.0, 1.0, 0.0, 0.83]
    fine = [(step + k, 200, 0.1, "http://a", 1) for k in range(20)]
    assert real.violation(fine, step, step + 20, 1.0, 5.0, 0.9)["violation_window_s"] == 0.0


def test_sim_bench_window_and_same_config_pairs(bench_module: Callable[[str, str], ModuleType]) -> None:
    sim = bench_module("bigpd_router", "bench_scaling_standby_sim")
    arrivals = [0.5 * k for k in range(60)]  # 30 s, 20 per 10 s bin
    missed = [t for t in arrivals if 10 <= t < 13]  # 6 of 20 missed in bin 1
    assert sim.violation_window_s(arrivals, missed) == sim.BIN_S
    assert sim.violation_window_s(arrivals, []) == 0.0
    fig = {"attainment": 0.9, "worst": 0.9, "instance_seconds": 100.0, "standby_seconds": 0.0, "violation_window_s": 40.0}
    rows = [{"cold_s": 30.0, "family": "cold", "up_load": 0.9, "min_prefill": 1, "standby": {}, "test": fig},
            {"cold_s": 30.0, "family": "standby", "up_load": 0.9, "min_prefill": 1, "standby": {"prefill": 1},
             "test": {**fig, "instance_seconds": 120.0, "standby_seconds": 20.0, "violation_window_s": 10.0}},
            {"cold_s": 30.0, "family": "standby", "up_load": 1.2, "min_prefill": 1, "standby": {"prefill": 1},
             "test": fig}]
    [pair] = sim.same_config(rows, 30.0)
    assert pair["standby_pool"] == "1P"
    assert pair["window_saved_s"] == 30.0 and pair["extra_instance_seconds"] == 20.0
    assert pair["window_saved_s_per_idle_s"] == 1.5
