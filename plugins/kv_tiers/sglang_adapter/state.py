"""Layer: SGLang adapter of the kv_tiers plugin. The process-wide `TierState` and its Prometheus meter.

`tiers()` builds the one `TierState` of this SGLang process on first use (by the storage backend
HiCache constructs, or by the first hook called) from the plugin's config when it is enabled
here, else from defaults overridden by keys of the backend's extra config; with the plugin
enabled a daemon thread publishes its snapshot for `GET /kllm/stats`.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierMeter, TierState

logger = logging.getLogger("kllm.kv_tiers")

PLUGIN = "kv_tiers"


class PrometheusMeter(TierMeter):
    """The state's counts as `kllm_kv_tiers_*_total` counters."""

    def __init__(self) -> None:
        self._pages = metrics.counter("kllm_kv_tiers_l3_pages_total", "L3 pages by outcome", ("outcome",))
        self._faults = metrics.counter("kllm_kv_tiers_l3_faults_total", "L3 pages refused or failed, by reason",
                                       ("reason",))
        self._prefetch = metrics.counter("kllm_kv_tiers_prefetch_decisions_total", "L3 prefetch gate decisions",
                                         ("reason",))
        self._holds = metrics.counter("kllm_kv_tiers_admission_holds_total",
                                      "L3-loaded L2 spans held until admission, by outcome", ("outcome",))

    def pages(self, outcome: str, n: int = 1) -> None:
        self._pages.labels(outcome).inc(n)

    def fault(self, reason: str, n: int = 1) -> None:
        self._faults.labels(reason).inc(n)

    def prefetch(self, reason: str) -> None:
        self._prefetch.labels(reason).inc()

    def hold(self, outcome: str) -> None:
        self._holds.labels(outcome).inc()


def _config(extra: dict[str, Any] | None = None) -> KvTiersConfig:
    """The plugin's config when enabled here; otherwise defaults overridden by extra-config keys."""
    if runtime.is_enabled(PLUGIN):
        return runtime.config_of(PLUGIN)
    fields = KvTiersConfig.__dataclass_fields__
    given = {k: v for k, v in (extra or {}).items() if k in fields}
    return KvTiersConfig(**given)


def _instance_id(cfg: KvTiersConfig) -> str:
    if cfg.instance_id:
        return cfg.instance_id
    try:
        from sglang.srt.runtime_context import get_server_args

        port = get_server_args().port
    except Exception:
        port = os.getpid()
    return f"{socket.gethostname()}:{port}"


def start_stats(state: TierState, interval_s: float = 0.5) -> None:
    """Publish snapshots for GET /kllm/stats from a daemon thread (only when they change)."""
    from kllm_plugins.stats import StatsWriter

    writer = StatsWriter(PLUGIN, interval_s)

    def loop() -> None:
        last: Any = None
        while True:
            time.sleep(interval_s)
            try:
                snap = state.snapshot()
                if snap != last:
                    writer.write(snap)
                    last = snap
            except Exception:  # never let stats kill serving
                logger.debug("kv_tiers stats write failed", exc_info=True)

    threading.Thread(target=loop, name="kllm-kv-tiers-stats", daemon=True).start()


_tiers: TierState | None = None
_tiers_lock = threading.Lock()


def tiers(extra: dict[str, Any] | None = None) -> TierState:
    """This process's state (built on first use; `extra`: the backend's extra config)."""
    global _tiers
    with _tiers_lock:
        if _tiers is None:
            cfg = _config(extra)
            _tiers = TierState(cfg, _instance_id(cfg), PrometheusMeter())
            if runtime.is_enabled(PLUGIN):
                start_stats(_tiers)
        return _tiers


def current() -> TierState | None:
    """This process's state if built (hooks that only observe do nothing before it is)."""
    return _tiers
