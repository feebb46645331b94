"""Layer: hook implementations (no SGLang import). Declares the trace plugin to the host."""
from __future__ import annotations

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.trace.config import TraceConfig
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec

ADAPTER = "kllm_plugins.plugins.trace.sglang_adapter"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="trace",
        summary="counts scheduler passes, prefill chunks and decode steps (log, Prometheus, /kllm/stats)",
        status="stable",
        options=(
            OptionSpec("log_interval_s", float, 10.0, "seconds between scheduler summary log lines (0: off)"),
            OptionSpec("publish_interval_s", float, 0.2, "seconds between snapshots for /kllm/stats"),
            OptionSpec("profile_path", str, "", "cProfile batch selection and write pstats here (debug; costs time)"),
        ),
        patches=(
            PatchSpec(
                target="sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
                impl=f"{ADAPTER}:around_get_next_batch_to_run",
                kind="around",
                why="observe each scheduler pass and the batch it chose",
                upstream="a scheduler observer/event hook (batch selected) in SGLang",
            ),
        ),
        config_factory=TraceConfig,
    )
