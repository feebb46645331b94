"""The prefill server of a disaggregated pair on the simulated clock: no decode pass, and the
order of prefills decides TTFT alone."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Callable

import pytest


@pytest.fixture
def pd(bench_module: Callable[[str, str], ModuleType]) -> ModuleType:
    return bench_module("fair_sched", "sim_pd")


def test_a_prefill_server_hands_every_request_off_at_its_first_token(
        pd: ModuleType, bench_module: Callable[[str, str], ModuleType]) -> None:
    sf = bench_module("fair_sched", "sim_frontier")
    se = bench_module("fair_sched", "sim_engine")
    _, rate, jobs, stock = sf.baselines("bursty", 2048, 0.85, 2, prefill_only=True)
    assert all(r.output_len == 1 for j in jobs for r in j)
    reqs = se.simulate(jobs[0], rate, "fcfs", 2048, se.COSTS["h100_8l"], pool_tokens=sf.POOL)
    assert all(r.finish_s == r.first_s for r in reqs)  # nothing decodes there
    assert all(math.isnan(m["tpot"]) for m in stock.values())
    # the stock orders still differ: serving short prompts first cuts the mean wait
    assert stock["shortest-prefill-first"]["mean"] < 0.8 * stock["fcfs"]["mean"]


def test_the_cell_checks_every_target_but_tpot_and_the_table_marks_the_cells_met(pd: ModuleType) -> None:
    c = pd.cell(("bursty", 2048, 0.85, 2))
    fair = c["policies"]["fair_sched"]
    assert set(fair["ratios"]) == set(pd.TTFT_TARGETS) and not any(k.startswith("tpot") for k in fair["ratios"])
    # on bursty prompts span several chunks: fair_sched's order beats shortest-prefill-first's mean there
    assert fair["ratios"]["mean <= best stock"] < 0.8 and not fair["missed"]
    spf = c["policies"]["shortest-prefill-first"]["ratios"]
    assert spf["mean <= best stock"] == 1.0  # it is the best stock policy on mean there
    summary = {"metrics": {"bursty@2048@0.85": c},
               "cells_meeting_ttft_targets": {p: int(not v["missed"]) for p, v in c["policies"].items()}}
    row = pd.table(summary).splitlines()[2]
    assert row.startswith("| bursty @ 2048 @ 0.85 |")
    assert row.count("✓") == sum(not v["missed"] for v in c["policies"].values())
    assert row.endswith("| - |")  # 2 seeds: no 3-seed subsets to count


def test_the_p99_miss_chance_counts_the_3_seed_subsets_above_fcfs(
        pd: ModuleType, bench_module: Callable[[str, str], ModuleType]) -> None:
    sf = bench_module("fair_sched", "sim_frontier")
    _, rate, jobs = sf.cell_jobs("lognormal", 2048, 0.6, 4, prefill_only=True)
    rows = {p: sf.seed_rows(jobs, rate, 2048, p, env)
            for p, env in (("fcfs", None), ("shortest-prefill-first", None), ("fair_sched", ()))}
    got = pd.p99_miss_chance(rows)
    p99 = {p: [r["p99"] for r in rows[p]] for p in ("fcfs", "fair_sched")}
    subsets = [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    above = [sum(p99["fair_sched"][i] for i in s) > sum(p99["fcfs"][i] for i in s) for s in subsets]
    assert got["fair_sched"] == pytest.approx(sum(above) / 4, abs=1e-3)
    assert 0.0 <= got["shortest-prefill-first"] <= 1.0
