"""The router's scaling simulation reads and writes the harness's one trace format (Mooncake JSONL),
and a written trace replays to the same simulated figures as the synthetic one."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from kllm_plugins.bench.trace import read_trace, write_trace

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bigpd_router"


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"kllm_test_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_a_written_trace_replays_to_the_same_simulation(tmp_path: Path) -> None:
    sim = load("bench_scaling_sim")
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
