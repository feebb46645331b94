"""Layer: host core. The one place metrics are created: `kllm_<plugin>_<what>_<unit>`.

Metrics are created lazily, so prometheus_client is imported after SGLang has set
PROMETHEUS_MULTIPROC_DIR (with `--enable-metrics`); then counters made in the scheduler process
show up in SGLang's own `/metrics`.
"""
from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"^kllm_[a-z0-9]+(_[a-z0-9]+)+$")
_metrics: dict[str, Any] = {}


def _check(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"metric name {name!r} must look like kllm_<plugin>_<what>_<unit>")


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    _check(name)
    if name not in _metrics:
        from prometheus_client import Counter

        _metrics[name] = Counter(name, doc, labels)
    return _metrics[name]


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    _check(name)
    if name not in _metrics:
        from prometheus_client import Gauge

        _metrics[name] = Gauge(name, doc, labels, multiprocess_mode="livesum")
    return _metrics[name]


def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Any:
    _check(name)
    if name not in _metrics:
        from prometheus_client import Histogram

        _metrics[name] = Histogram(name, doc, labels, buckets=buckets)
    return _metrics[name]
