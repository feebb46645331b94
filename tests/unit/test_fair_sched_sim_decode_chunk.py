"""A smaller pass while requests decode, on the simulated clock (`sim_engine.pass_chunk`,
`sim_decode_chunk.py`): the cap applies only to mixed passes with requests decoding, under a stock
order and under fair_sched, and the recorded study is what its doc table shows."""
from __future__ import annotations

import json
from types import ModuleType
from typing import Callable


def _prefill_rows(se: ModuleType, trace: list, policy: object) -> list[list[int]]:
    """New tokens of every prefill row, pass by pass."""
    passes: list[list[int]] = []
    orig = se.Costs.prefill

    def timed(self: object, rows: list[tuple[int, int]]) -> float:
        passes.append([k for k, _ in rows])
        return orig(self, rows)

    se.Costs.prefill = timed
    try:
        se.simulate(trace, 1.0, policy, 2048, se.COSTS["h100_8l"])
    finally:
        se.Costs.prefill = orig
    return passes


def test_a_decode_chunk_caps_only_mixed_passes_with_requests_decoding(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    se = bench_module("fair_sched", "sim_engine")
    tr = bench_module("fair_sched", "traces")
    # a long prompt alone, then a short one that decodes while the long one's second prompt prefills
    alone = [tr.TraceRequest(0.0, 8192, 2, ())]
    beside = [tr.TraceRequest(0.0, 60, 200, ()), tr.TraceRequest(0.001, 8192, 2, ())]
    capped = se.EngineWith("shortest-prefill-first", mixed=True, decode_chunk=512)
    assert _prefill_rows(se, alone, capped) == [[2048]] * 4  # nothing decodes: whole chunks
    rows = _prefill_rows(se, beside, capped)
    assert rows[0] == [60] and max(sum(p) for p in rows[1:]) == 512 and sum(map(sum, rows)) == 8252
    # without mixed chunk nothing decodes inside a prefill pass, and the cap does not apply
    unmixed = _prefill_rows(se, beside, se.EngineWith("shortest-prefill-first", mixed=False, decode_chunk=512))
    assert max(sum(p) for p in unmixed) == 2048
    # fair_sched with mixed_decode reads the same cap (make_policy passes it to FairSingle)
    cfg = bench_module("fair_sched", "grid").config_from(["mixed_decode=1"])
    pol = se.make_policy(se.EngineWith("fair_sched", decode_chunk=512), 2048, cfg)
    assert pol.decode_chunk == 512
    fair_rows = _prefill_rows(se, beside, pol)
    assert max(sum(p) for p in fair_rows[1:]) <= 512 and sum(map(sum, fair_rows)) == 8252


def test_meets_reads_every_target_and_skips_missing_ratios(bench_module: Callable[[str, str], ModuleType]) -> None:
    sd = bench_module("fair_sched", "sim_decode_chunk")
    names = [t[0] for t in sd.targets.TARGETS]
    ok = dict(zip(names, (1.0, 0.9, 1.0, None, 1.3, 0.98)))
    assert sd.meets(ok)
    assert not sd.meets({**ok, "tpot <= 1.3x fcfs": 1.31})
    assert not sd.meets({**ok, "throughput >= 0.98x fcfs": 0.97})
    assert not sd.meets({**ok, "mean <= best stock": 1.01})


def test_the_recorded_study_is_the_doc_table(bench_module: Callable[[str, str], ModuleType]) -> None:
    sd = bench_module("fair_sched", "sim_decode_chunk")
    summary = json.loads(sd.OUT.read_text())
    text = sd.DOC.read_text()
    assert sd.render(text, summary) == text, "run: python benchmarks/fair_sched/sim_decode_chunk.py --write-doc"
    # every cell carries every candidate at every decode chunk
    for m in summary["metrics"].values():
        assert {label for label, _, _ in sd.CANDIDATES} == set(m["candidates"])
        assert all(set(v) == {sd.share_name(s) for s in sd.SHARES} for v in m["candidates"].values())
