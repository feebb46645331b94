"""The router's scaling simulation reads and writes the harness's one trace format (Mooncake JSONL),
and a written trace replays to the same simulated figures as the synthetic one."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Callable

from kllm_plugins.bench.trace import read_trace, write_trace


def test_a_written_trace_replays_to_the_same_simulation(tmp_path: Path, bench_module: Callable[[str, str], ModuleType]) -> None:
    sim = bench_module("bigpd_router", "bench_scaling_sim")
    reqs = sim.trace(4, 60.0)
    path = write_trace(tmp_path / "t.jsonl", sim.to_records(reqs))
    back = sim.from_records(read_trace(path))
    assert [(r.inp, r.out) for r in back] == [(r.inp, r.out) for r in reqs]
    assert all(abs(b.t - r.t) < 1e-3 for b, r in zip(back, reqs))  # ms timestamps
    policy = sim.ScalePolicy(up_load=0.75, down_load=0.3, up_sustain_s=5.0, down_sustain_s=60, cooldown_s=20.0,
                             min_instances=2, max_instances=8, drain_timeout_s=120, urgent_load=1.5)
    a = sim.simulate(reqs, "fixed", 2, 10.0, policy)
    b = sim.simulate(back, "fixed", 2, 10.0, policy)
    assert a["slo_attainment"] == b["slo_attainment"] and a["instance_seconds"] == b["instance_seconds"] > 0
    assert len(a["missed_at"]) == len(b["missed_at"])
