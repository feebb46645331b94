"""The latency-shift study: where the TTFT a short-first order saves goes, on the simulated clock."""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import pytest


@pytest.fixture
def shift(bench_module: Callable[[str, str], ModuleType]) -> ModuleType:
    return bench_module("fair_sched", "sim_latency_shift")


def test_a_short_prompt_served_first_finishes_when_it_would_have_under_fcfs(
        shift: ModuleType, bench_module: Callable[[str, str], ModuleType]) -> None:
    """One long prompt, then a short one arriving while it prefills: without mixed chunk the engine
    prefers prefill, so serving the short one first moves its wait from TTFT into decode, and its
    last token comes no sooner; with mixed chunk it decodes during the long prefill and finishes
    sooner."""
    se = bench_module("fair_sched", "sim_engine")
    tr = bench_module("fair_sched", "traces")
    trace = [tr.TraceRequest(0.0, 16 * 2048, 8, ()), tr.TraceRequest(0.001, 200, 8, ())]
    cm = se.COSTS["h100_8l"]

    def short(policy: object) -> object:
        return se.simulate(trace, 1.0, policy, 2048, cm)[1]

    fcfs, spf = short("fcfs"), short("shortest-prefill-first")
    mixed = short(se.EngineWith("shortest-prefill-first", mixed=True))
    assert spf.first_s < 0.2 * fcfs.first_s  # first token long before the long prompt's prefill ends
    assert spf.finish_s == pytest.approx(fcfs.finish_s, rel=0.02)  # the last one no sooner
    assert mixed.finish_s < 0.9 * fcfs.finish_s


def test_the_accounting_is_the_identity_end_to_end_equals_ttft_plus_decode(shift: ModuleType) -> None:
    c = shift.cell(("issue", 2048, 0.85, 2))
    f = c["fcfs"]
    assert f["e2e"] == pytest.approx(f["mean"] + f["decode"])
    spf = c["policies"]["shortest-prefill-first"]
    saved, added = spf["ttft_saved_s"], spf["decode_added_s"]
    assert saved > 0 and spf["shift"] == pytest.approx(added / saved)
    # end to end moves by what decode adds less what TTFT saves
    assert spf["e2e_vs_fcfs"] * f["e2e"] == pytest.approx(f["e2e"] - saved + added)
    b = c["budget"]
    assert b["allowed_decode_growth_s"] == pytest.approx(0.3 * f["decode"])
    assert b["shift_allowed"] == pytest.approx(b["allowed_decode_growth_s"] / b["needed_saving_s"])


def test_where_short_prompts_fit_one_chunk_the_saving_comes_back_as_decode_time(shift: ModuleType) -> None:
    """On `issue` every policy that reaches the best stock mean gives back most of its TTFT saving
    as decode time, more than TPOT within 1.3x fcfs's allows, and none is marked as within it."""
    c = shift.cell(("issue", 2048, 0.85, 4))
    needed, allowed = c["budget"]["needed_saving_s"], c["budget"]["shift_allowed"]
    reaching = [a for a in c["policies"].values() if a["ttft_saved_s"] >= needed - 1e-12]
    assert reaching and all(a["shift"] > max(0.5, allowed) for a in reaching)
    assert shift.within(c) is None


def test_the_table_marks_only_policies_within_every_limit(shift: ModuleType) -> None:
    cells = {f"{t}@2048@0.85": shift.cell((t, 2048, 0.85, 2)) for t in ("issue", "bursty")}
    text = shift.table({"metrics": cells})
    assert text.count("| issue @ 2048 @ 0.85 |") == 1 and "✓" not in text.splitlines()[2]
    marked = {k: shift.within(c, p99=True) for k, c in cells.items()}
    rows = text.splitlines()[2:2 + len(cells)]
    assert sum(r.count("✓") for r in rows) == sum(v is not None for v in marked.values())
