"""Stats files, trace counters, hardware adapters, platform selection, metric names, layering."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kllm_plugins import metrics, stats
from kllm_plugins.hardware import get_adapter
from kllm_plugins.hardware.cpu import platform_entry
from kllm_plugins.plugins.trace.config import TraceConfig
from kllm_plugins.plugins.trace.counters import SchedulerCounters

ROOT = Path(__file__).resolve().parents[2]


def test_stats_writer_rate_limits_busy_and_flushes_idle(tmp_path: Path) -> None:
    w = stats.StatsWriter("demo", interval_s=3600, run_dir=str(tmp_path))
    w.update(lambda: {"n": 1}, changed=True)  # first busy write goes out
    w.update(lambda: {"n": 2}, changed=True)  # within the interval: held back
    assert json.loads(Path(w.path).read_text())["data"] == {"n": 1}
    w.update(lambda: {"n": 2}, changed=False)  # idle: flush the pending change
    assert json.loads(Path(w.path).read_text())["data"] == {"n": 2}
    writes = w.writes
    w.update(lambda: {"n": 2}, changed=False)  # idle, nothing new: no write
    assert w.writes == writes
    built: list[int] = []
    w.update(lambda: built.append(1) or {"n": 3}, changed=True)  # held back: snapshot never built
    assert built == []


def test_read_all_sums_processes(tmp_path: Path) -> None:
    for pid, n in ((1, 3), (2, 4)):
        (tmp_path / f"trace.{pid}.json").write_text(json.dumps({"pid": pid, "data": {"passes": n, "flag": True}}))
    (tmp_path / "trace.3.json").write_text("{torn")
    out = stats.read_all(str(tmp_path))
    assert out["trace"]["total"] == {"passes": 7}
    assert set(out["trace"]["processes"]) == {"1", "2"}


def test_trace_counters_count_chunks_and_steps() -> None:
    c = SchedulerCounters()
    for _ in range(7):  # a 446-token prompt in 64-token chunks
        c.observe("prefill", num_reqs=1, new_tokens=64)
    c.observe("decode", num_reqs=3, seconds=0.5)
    c.observe(None, seconds=0.25)
    snap = c.snapshot()
    assert snap["select_seconds"] == 0.75 and snap["select_seconds_max"] == 0.5
    assert snap["prefill_select_seconds"] == 0.0
    c.observe("prefill", num_reqs=1, new_tokens=64, seconds=0.125)
    assert c.snapshot()["prefill_select_seconds"] == 0.125
    c.prefill_chunks, c.prefill_tokens, c.passes = 7, 448, 9
    snap = c.snapshot()
    assert snap["prefill_chunks"] == 7 and snap["prefill_tokens"] == 448
    assert snap["decode_steps"] == 1 and snap["decode_tokens"] == 3
    assert snap["passes"] == 9 and snap["idle_passes"] == 1
    with pytest.raises(ValueError):
        c.observe("mixed")


def test_trace_config_validation() -> None:
    with pytest.raises(ValueError, match="publish_interval_s"):
        TraceConfig(publish_interval_s=0)
    with pytest.raises(ValueError, match="log_interval_s"):
        TraceConfig(log_interval_s=-1)


def test_metric_names_follow_convention() -> None:
    with pytest.raises(ValueError, match="kllm_<plugin>_<what>_<unit>"):
        metrics.counter("trace_passes", "bad name")


def test_cpu_adapter_basics(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("KLLM_DEVICE", "cpu")
    a = get_adapter()
    assert a.name == "cpu" and a.collective_backend() == "gloo"
    src = torch.arange(6, dtype=torch.float32)
    dst = a.host_buffer((6,), torch.float32)
    a.copy_async(dst, src, a.new_stream())
    ev = a.new_event()
    ev.record()
    assert ev.query() and torch.equal(dst, src)
    monkeypatch.setenv("KLLM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="valid choices: cpu, cuda"):
        get_adapter()


def test_cpu_platform_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("SGLANG_PLATFORM", "KLLM_DEVICE", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(k, raising=False)
    assert platform_entry.activate() is None  # never takes over a machine by itself
    monkeypatch.setenv("SGLANG_PLATFORM", "kllm_cpu")
    assert platform_entry.activate() == platform_entry.PLATFORM_CLASS
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    with pytest.raises(RuntimeError, match="unset SGLANG_USE_CPU_ENGINE"):
        platform_entry.activate()


def _core_modules() -> list[str]:
    mods = ["kllm_plugins.spec", "kllm_plugins.hookspecs", "kllm_plugins.manager", "kllm_plugins.options",
            "kllm_plugins.attach", "kllm_plugins.stats", "kllm_plugins.runtime", "kllm_plugins.hardware"]
    for cap in sorted((ROOT / "plugins").iterdir()):
        if not cap.is_dir() or cap.name.startswith("_"):
            continue
        for name in ("core", "config", "counters", "hookimpls"):
            if (cap / f"{name}.py").exists() or (cap / name / "__init__.py").exists():
                mods.append(f"kllm_plugins.plugins.{cap.name}.{name}")
        core = cap / "core"
        if core.is_dir():
            mods += [f"kllm_plugins.plugins.{cap.name}.core.{p.stem}" for p in sorted(core.glob("*.py")) if p.stem != "__init__"]
    return mods


def test_core_modules_import_without_sglang() -> None:
    """House rule by test: core, config and hookimpls modules never import SGLang."""
    mods = _core_modules()
    code = (
        "import sys, importlib\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang' or name.startswith('sglang.'):\n"
        "            raise ImportError('sglang is blocked in this test: ' + name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
