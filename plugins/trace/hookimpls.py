"""Layer: hook implementations (no SGLang import). Declares the trace plugin to the host."""
from __future__ import annotations

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.trace.config import TraceConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.trace.sglang_adapter"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="trace",
        summary="counts scheduler passes, prefill chunks and decode steps (log, Prometheus, /kllm/stats)",
        status="stable",
        options=options_from_config(TraceConfig),
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
