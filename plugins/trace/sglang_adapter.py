"""Layer: SGLang adapter of the trace plugin. The only module of the plugin that touches SGLang objects."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.trace.counters import SchedulerCounters
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.trace")


class _Tracer:
    def __init__(self) -> None:
        cfg = runtime.config_of("trace")
        self.counters = SchedulerCounters()
        self.writer = StatsWriter("trace", cfg.publish_interval_s)
        self.log_interval_s = cfg.log_interval_s
        self._last_log = time.monotonic()
        self._m_passes = metrics.counter("kllm_trace_scheduler_passes_total", "Scheduler batch-selection passes")
        self._m_chunks = metrics.counter("kllm_trace_prefill_chunks_total", "Prefill chunks (request x extend batch)")
        self._m_decode = metrics.counter("kllm_trace_decode_steps_total", "Decode batches run")
        self._m_select = metrics.counter(
            "kllm_trace_batch_select_seconds_total", "Wall time in batch selection (get_next_batch_to_run)"
        )
        self.profiler: Any = None
        self.profile_path = ""
        self._last_dump = time.monotonic()
        if cfg.profile_path:
            import cProfile
            import os

            self.profiler = cProfile.Profile()
            self.profile_path = f"{cfg.profile_path}.{os.getpid()}"

    def observe(self, batch: Any, seconds: float) -> None:
        kind, num_reqs, new_tokens = _describe(batch)
        self.counters.observe(kind, num_reqs, new_tokens, seconds)
        self._m_select.inc(seconds)
        self._m_passes.inc()
        if kind == "prefill":
            self._m_chunks.inc(num_reqs)
        elif kind == "decode":
            self._m_decode.inc()
        # Busy passes publish at most every interval; the first idle pass flushes what is pending.
        self.writer.update(self.counters.snapshot, changed=kind is not None)
        if self.log_interval_s and kind is not None:
            now = time.monotonic()
            if now - self._last_log >= self.log_interval_s:
                self._last_log = now
                logger.info("kllm trace: %s", self.counters.snapshot())
        if self.profiler is not None and time.monotonic() - self._last_dump >= 2.0:
            self._last_dump = time.monotonic()
            self.profiler.dump_stats(self.profile_path)


def _describe(batch: Any) -> tuple[str | None, int, int]:
    if batch is None:
        return None, 0, 0
    mode = getattr(batch, "forward_mode", None)
    reqs = getattr(batch, "reqs", None) or []
    if mode is not None and mode.is_decode():
        return "decode", len(reqs), len(reqs)
    if mode is not None and mode.is_extend():
        lens = getattr(batch, "extend_lens", None) or []
        return "prefill", len(reqs), int(sum(lens))
    return None, 0, 0


_tracer: _Tracer | None = None


def around_get_next_batch_to_run(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    global _tracer
    if _tracer is None:
        _tracer = _Tracer()
    prof = _tracer.profiler
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    try:
        plan = original(self, *args, **kwargs)
    finally:
        if prof is not None:
            prof.disable()
    _tracer.observe(getattr(plan, "batch_to_run", plan), time.perf_counter() - t0)
    return plan
