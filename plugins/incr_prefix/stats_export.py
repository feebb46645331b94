"""Layer: plugin glue (no SGLang import). Publishes the checkpoint counters of one cache.

Counters go to Prometheus (`kllm_incr_prefix_*`, visible in SGLang's /metrics with
--enable-metrics) and to /kllm/stats snapshots, rate-limited by `publish_interval_s`.
"""
from __future__ import annotations

import logging
from typing import Any

from kllm_plugins import metrics
from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
from kllm_plugins.plugins.incr_prefix.core.walk_state import IncrCounters
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.incr_prefix")


class CounterExporter:
    """Called by the cache after each checkpoint with its counters."""

    def __init__(self, config: IncrPrefixConfig) -> None:
        self.writer = StatsWriter("incr_prefix", config.publish_interval_s)
        self._m_tail = metrics.counter("kllm_incr_prefix_tail_inserts_total", "Chunk checkpoints served by a tail-only insert")
        self._m_full = metrics.counter(
            "kllm_incr_prefix_full_walks_total", "Chunk checkpoints served by the stock root walk", ("reason",)
        )
        self._m_skipped = metrics.counter(
            "kllm_incr_prefix_skipped_tokens_total", "Protected-prefix tokens the tail-only inserts did not re-walk"
        )
        self._last: dict[str, Any] = {"tail_inserts": 0, "skipped_tokens": 0, "full_by_reason": {}}

    def __call__(self, counters: IncrCounters, flush: bool = False) -> None:
        last = self._last
        self._m_tail.inc(counters.tail_inserts - last["tail_inserts"])
        self._m_skipped.inc(counters.skipped_tokens - last["skipped_tokens"])
        for reason, n in counters.full_by_reason.items():
            delta = n - last["full_by_reason"].get(reason, 0)
            if delta:
                self._m_full.labels(reason=reason).inc(delta)
        self._last = {
            "tail_inserts": counters.tail_inserts,
            "skipped_tokens": counters.skipped_tokens,
            "full_by_reason": dict(counters.full_by_reason),
        }
        try:
            if flush:
                self.writer.write(counters.snapshot())
            else:
                self.writer.update(counters.snapshot(), changed=True)
        except OSError as exc:  # a stats directory problem must never break a checkpoint
            logger.debug("incr_prefix: stats write failed: %s", exc)
