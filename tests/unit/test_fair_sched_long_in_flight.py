"""The figures benchmarks/fair_sched/long_in_flight.py records: which shorts count, the ratios, variants."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable

import pytest


def outcome(m: ModuleType, rid: str, kind: str, arrival: float, ttft: float, out: list[int] | None = None) -> Any:
    return m.Outcome(rid, kind, 100, arrival, ttft, ttft + 0.5, len(out or [1]), out or [1], "length")


def test_run_metrics_counts_only_shorts_that_arrived_before_the_long_first_token(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    outs = [outcome(m, "long", "long", 0.0, 2.0), outcome(m, "a", "short", 0.5, 1.0),
            outcome(m, "b", "short", 1.0, 3.0), outcome(m, "late", "short", 2.5, 9.0),
            outcome(m, "m", "medium", 1.0, 4.0)]
    r = m.run_metrics(outs)
    assert r["short_n"] == 2 and r["short_mean"] == 2.0 and r["short_max"] == 3.0
    assert r["short_p90"] == pytest.approx(2.8)  # numpy's linear percentile of [1, 3]
    assert r["medium_mean"] == r["medium_max"] == 4.0 and r["long_ttft"] == 2.0
    assert r["medium_before_long"] == 0  # its first token at 5.0, after the long's at 2.0
    assert r["wall"] == 2.5 + 9.5  # the late short ends last
    assert math.isnan(m.run_metrics(outs[:1])["short_mean"])


def test_same_outputs_compares_each_request_by_rid(bench_module: Callable[[str, str], ModuleType]) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    ref = [outcome(m, "x", "short", 0, 1, [1, 2]), outcome(m, "y", "short", 0, 1, [3])]
    assert m.same_outputs(ref[::-1], ref)
    assert not m.same_outputs([ref[0], outcome(m, "y", "short", 0, 1, [4])], ref)
    assert not m.same_outputs(ref[:1], ref)


def test_summary_ratios_name_the_best_other_stock_policy(bench_module: Callable[[str, str], ModuleType]) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    nan = float("nan")
    base = dict.fromkeys(m.METRICS, 1.0) | {"short_n": 3.0, "medium_before_long": 0.0}
    runs = []
    for seed, scale in ((0, 1.0), (1, 2.0)):
        for name, short in (("fcfs", 4.0), ("hrrn", 2.0), ("fair_sched", 0.5)):
            runs.append({"setup": name, "seed": seed, **base, "short_mean": short * scale, "same_as_fcfs": True})
        runs.append({"setup": "fair_sched", "seed": seed, "error": "server exited"} if seed else
                    {"setup": "lpm", "seed": seed, **base, "medium_mean": nan, "same_as_fcfs": False})
    s = m.summarize(runs, ["fcfs", "hrrn", "lpm", "fair_sched"])
    f = s["fair_sched"]
    assert f["runs"] == 2 and f["failed"] == 1 and f["same_as_fcfs"] is True
    assert f["short_mean"]["s"]["median"] == 0.75 and f["short_mean"]["vs_fcfs"]["ratio"] == 0.125
    assert f["short_mean"]["vs_best_stock"]["policy"] == "lpm"  # lpm's 1.0 beats hrrn's 3.0
    assert s["hrrn"]["short_mean"]["vs_best_stock"]["policy"] == "lpm"  # never itself
    assert "medium_mean" not in s["lpm"] and s["lpm"]["same_as_fcfs"] is False
    assert s["fcfs"]["medium_mean"]["vs_best_stock"]["policy"] == "hrrn"  # lpm's NaN figure is left out


def test_variants_become_fair_sched_setups(bench_module: Callable[[str, str], ModuleType]) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    v = m.parse_variants(["nocut:long_min_share=1.0,KLLM_FAIR_SCHED_SHORT_EXTRA_TOKENS=0"])
    assert v == {"fair_sched/nocut": (["fair_sched"], {"KLLM_FAIR_SCHED_LONG_MIN_SHARE": "1.0",
                                                       "KLLM_FAIR_SCHED_SHORT_EXTRA_TOKENS": "0"}, "fcfs")}
    for bad in ("notag", ":a=1", "t:a", "t:a=1,b"):
        with pytest.raises(ValueError, match="TAG:KEY=V"):
            m.parse_variants([bad])


def test_workload_draws_lengths_from_the_given_ranges_and_repeats_per_seed(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    import argparse

    m = bench_module("fair_sched", "long_in_flight")
    ap = argparse.ArgumentParser()
    m.add_workload_args(ap, long_tokens=100_000, rate=2.0, lead_s=0.5, short=(1, 2), medium=(3, 4), chunk=8192)
    a = ap.parse_args(["--short-len", "256", "4096", "--medium-len", "12000", "30000", "--shorts", "20"])
    jobs = m.workload(a, 0)
    by = {k: [len(j.input_ids) for j in jobs if j.kind == k] for k in ("long", "short", "medium")}
    assert by["long"] == [100_000] and len(by["short"]) == 20 and len(by["medium"]) == 3
    assert all(256 <= n <= 4096 for n in by["short"]) and all(12_000 <= n <= 30_000 for n in by["medium"])
    assert min(j.arrival_s for j in jobs if j.kind != "long") >= 0.5
    assert [j.input_ids for j in m.workload(a, 0)] == [j.input_ids for j in jobs]
    assert ap.parse_args([]).short_len == [1, 2]  # each benchmark's own defaults


def test_fair_totals_reads_the_summed_counters_and_never_raises(bench_module: Callable[[str, str], ModuleType]) -> None:
    from types import SimpleNamespace

    sv = bench_module("fair_sched", "serving")
    srv = SimpleNamespace(get_json=lambda path: {"fair_sched": {"total": {"ride_passes": 3, "limited_passes": None}}}
                          if path == "/kllm/stats" else {})
    assert sv.fair_totals(srv, ["ride_passes", "limited_passes", "absent"]) == \
        {"ride_passes": 3.0, "limited_passes": 0.0, "absent": 0.0}

    def down(path: str) -> dict:
        raise ConnectionError(path)

    assert sv.fair_totals(SimpleNamespace(get_json=down), ["ride_passes"]) == {}
