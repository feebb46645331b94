"""Layer: plugin glue (no SGLang import). Publishes the checkpoint counters of one cache.

Counters go to Prometheus (`kllm_incr_prefix_*`, visible in SGLang's /metrics with
--enable-metrics) and to /kllm/stats snapshots. The scheduler only marks the counters dirty (one
attribute store per checkpoint); a daemon thread publishes them every `publish_interval_s`, so
no checkpoint pays for a metric update or a file write.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kllm_plugins import metrics
from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
from kllm_plugins.plugins.incr_prefix.core.walk_state import IncrCounters
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.incr_prefix")


class CounterExporter:
    """Called by the cache after each checkpoint with its counters."""

    def __init__(self, config: IncrPrefixConfig, start_thread: bool = True) -> None:
        self.interval_s = config.publish_interval_s
        self.writer = StatsWriter("incr_prefix", config.publish_interval_s)
        self._counters: IncrCounters | None = None
        self._dirty = False
        self._start_thread = start_thread
        self._thread: threading.Thread | None = None
        self._m_tail = metrics.counter("kllm_incr_prefix_tail_inserts_total", "Chunk checkpoints served by a tail-only insert")
        self._m_full = metrics.counter(
            "kllm_incr_prefix_full_walks_total", "Chunk checkpoints served by the stock root walk", ("reason",)
        )
        self._m_skipped = metrics.counter(
            "kllm_incr_prefix_skipped_tokens_total", "Protected-prefix tokens the tail-only inserts did not re-walk"
        )
        self._m_rematch = metrics.counter(
            "kllm_incr_prefix_waiting_matches_total", "Waiting-queue prefix matches", ("route",)
        )
        self._m_seconds = metrics.counter(
            "kllm_incr_prefix_checkpoint_seconds_total", "Wall time in chunk checkpoints", ("route",)
        )
        self._last: dict[str, Any] = {
            "tail_inserts": 0, "skipped_tokens": 0, "full_by_reason": {}, "tail_seconds": 0.0, "full_seconds": 0.0,
            "rematch_skipped": 0, "rematch_done": 0,
        }

    def __call__(self, counters: IncrCounters) -> None:
        """Mark `counters` for publishing (cheap: called from the scheduler on every checkpoint)."""
        self._counters = counters
        self._dirty = True
        if self._thread is None and self._start_thread:
            self._thread = threading.Thread(target=self._loop, name="kllm-incr-prefix-stats", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            if self._dirty:
                self.sync()

    def sync(self) -> None:
        """Publish the latest counters to Prometheus and /kllm/stats."""
        counters = self._counters
        if counters is None:
            return
        self._dirty = False
        last = self._last
        self._m_tail.inc(counters.tail_inserts - last["tail_inserts"])
        self._m_skipped.inc(counters.skipped_tokens - last["skipped_tokens"])
        for reason, n in counters.full_by_reason.items():
            delta = n - last["full_by_reason"].get(reason, 0)
            if delta:
                self._m_full.labels(reason=reason).inc(delta)
        self._m_seconds.labels(route="tail").inc(counters.tail_seconds - last["tail_seconds"])
        self._m_seconds.labels(route="full").inc(counters.full_seconds - last["full_seconds"])
        self._m_rematch.labels(route="memo").inc(counters.rematch_skipped - last["rematch_skipped"])
        self._m_rematch.labels(route="walk").inc(counters.rematch_done - last["rematch_done"])
        self._last = {
            "rematch_skipped": counters.rematch_skipped,
            "rematch_done": counters.rematch_done,
            "tail_seconds": counters.tail_seconds,
            "full_seconds": counters.full_seconds,
            "tail_inserts": counters.tail_inserts,
            "skipped_tokens": counters.skipped_tokens,
            "full_by_reason": dict(counters.full_by_reason),
        }
        try:
            self.writer.write(counters.snapshot())
        except OSError as exc:  # a stats directory problem must never break the scheduler
            logger.debug("incr_prefix: stats write failed: %s", exc)
