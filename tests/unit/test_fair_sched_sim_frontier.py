"""The search over settings on the simulated clock (`sim_frontier.py`): what it counts as meeting the
targets, which candidates its TPOT columns may pick, and that a stock order with SGLang's mixed chunk
really decodes inside prefill passes."""
from __future__ import annotations

from types import ModuleType
from typing import Callable

RATIOS = ("mean <= best stock", "short p90 <= best stock", "p99 <= fcfs", "long mean <= 1.25x fcfs",
          "tpot <= 1.3x fcfs", "throughput >= 0.98x fcfs")


def _result(name: str, mean: float, p99: float, tpot: float, thr: float = 1.0) -> dict:
    ratios = dict(zip(RATIOS, (mean, 0.5, p99, 1.0, tpot, thr)))
    limits = {"mean <= best stock": 1.0, "short p90 <= best stock": 1.0, "p99 <= fcfs": 1.0,
              "long mean <= 1.25x fcfs": 1.25, "tpot <= 1.3x fcfs": 1.3}
    missed = [k for k, lim in limits.items() if ratios[k] > lim] + (["throughput >= 0.98x fcfs"] if thr < 0.98 else [])
    return {"name": name, "ratios": ratios, "missed": missed}


def test_digest_picks_tpot_only_among_candidates_that_win_the_mean(bench_module: Callable[[str, str], ModuleType]) -> None:
    sf = bench_module("fair_sched", "sim_frontier")
    results = [_result("fcfs-like", 1.40, 1.00, 1.00),    # P99 and TPOT fine, loses the mean
               _result("spf-like", 1.00, 1.05, 1.60),     # wins the mean, P99 and TPOT miss
               _result("middle", 0.95, 0.98, 1.80),       # wins the mean and keeps P99, TPOT misses
               _result("slow", 0.90, 0.90, 1.10, 0.90)]   # all but throughput
    d = sf.digest(results)
    assert d["meet_all"] == []
    assert d["best_tpot_at_mean"]["name"] == "slow" and d["best_tpot_at_mean"]["of"] == 3
    assert d["best_tpot_at_mean_and_p99"]["name"] == "slow" and d["best_tpot_at_mean_and_p99"]["of"] == 2
    assert d["nearest"]["name"] == "slow" and d["nearest"]["missed"] == ["throughput >= 0.98x fcfs"]
    assert sf.digest([*results, _result("all", 0.99, 0.99, 1.29)])["meet_all"] == ["all"]
    assert sf.digest(results[:1])["best_tpot_at_mean"] is None


def test_cells_met_counts_each_setting_across_cells_and_keeps_counts_in_the_cells(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    sf = bench_module("fair_sched", "sim_frontier")
    mixed = sf.DEFAULTS.replace("mixed_decode=0", "mixed_decode=1")
    spf_interval = sf.interval_name("shortest-prefill-first", False, 2)
    metrics = {"a@2048@0.6": {"meet_all": [sf.DEFAULTS, mixed, "x", "shortest-prefill-first (stock)", spf_interval]},
               "b@2048@0.6": {"meet_all": [mixed, "x", "shortest-prefill-first + mixed chunk", spf_interval]},
               "c@2048@0.6": {"meet_all": []}}
    met = sf.cells_met(metrics)
    assert [m["meet_all"] for m in metrics.values()] == [5, 4, 0]
    assert met["references"]["fair_sched defaults"] == 1
    assert met["references"]["fair_sched defaults + mixed_decode"] == 2
    assert met["references"]["shortest-prefill-first"] == 1
    assert met["references"]["shortest-prefill-first + mixed chunk"] == 1
    assert met["references"]["hrrn"] == 0
    assert met["stock_with_interval"][spf_interval] == 2 and met["stock_with_interval"][sf.interval_name("fcfs", True, 1)] == 0
    # the stock orders do not count as fair_sched settings
    assert met["fair_sched_most"] == {"cells": 2, "settings": 2, "first": sorted([mixed, "x"])}


def test_a_stock_order_with_mixed_chunk_decodes_inside_prefill_passes(bench_module: Callable[[str, str], ModuleType]) -> None:
    se = bench_module("fair_sched", "sim_engine")
    tr = bench_module("fair_sched", "traces")
    # a short request decodes while a long one prefills chunk after chunk
    trace = [tr.TraceRequest(0.0, 60, 6, ()), tr.TraceRequest(0.001, 20000, 4, ())]
    plain, mixed = (se.simulate(trace, 1.0, p, 2048, se.COSTS["h100_8l"]) for p in ("fcfs", se.EngineWith("fcfs", mixed=True)))
    # fcfs never decodes while a prompt waits for its next chunk; with mixed chunk the short one
    # finishes while the long one still prefills
    assert plain[0].finish_s > plain[1].first_s
    assert mixed[0].finish_s < mixed[1].first_s


def test_prefill_decode_interval_decodes_between_prefill_passes(bench_module: Callable[[str, str], ModuleType]) -> None:
    se = bench_module("fair_sched", "sim_engine")
    tr = bench_module("fair_sched", "traces")
    # SGLang's --prefill-decode-interval: N decode rounds after each prefill pass while requests decode
    trace = [tr.TraceRequest(0.0, 60, 40, ()), tr.TraceRequest(0.001, 20000, 4, ())]
    runs = {k: se.simulate(trace, 1.0, se.EngineWith("fcfs", False, k), 2048, se.COSTS["h100_8l"]) for k in (0, 4)}
    # without it the short one decodes only once the long one has its first token; with 4 decode
    # rounds after each of the long prompt's 10 passes it finishes its 40 tokens before that ...
    assert runs[0][0].finish_s > runs[0][1].first_s
    assert runs[4][0].finish_s < runs[4][1].first_s
    assert runs[4][1].first_s > runs[0][1].first_s  # ... and the long prompt's first token comes later
    assert runs[0][1].first_s == se.simulate(trace, 1.0, "fcfs", 2048, se.COSTS["h100_8l"])[1].first_s


def test_the_family_covers_every_decode_setting_with_and_without_mixed_chunk(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    sf = bench_module("fair_sched", "sim_frontier")
    fam = sf.family()
    names = [n for n, _, _ in fam]
    assert len(names) == len(set(names)) == 3 + 3 * 2 * 3 + 5 * 7 * 2 * 3 * 2 * 3
    assert sf.interval_name("hrrn", True, 4) in names
    fair = [env for _, p, env in fam if p == "fair_sched"]
    assert any("mixed_decode=1" in e and "decode_time_share=0.2" in e and "max_partial_prefills=2" in e for e in fair)
    assert sf.DEFAULTS in names and any("short_extra_tokens=0" in e for e in fair)
