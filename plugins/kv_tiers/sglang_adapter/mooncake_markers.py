"""Layer: SGLang adapter of the kv_tiers plugin. Offer markers of the Mooncake backend in its store.

The core `SharedSightings` counts a page's sighting on one instance on every instance of a
Mooncake master through one-byte objects next to the pages (`MooncakeMarkers`); the counter
`kllm_kv_tiers_shared_sightings_total{outcome}` counts what they saw.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from kllm_plugins import metrics


def m_sightings() -> Any:
    return metrics.counter("kllm_kv_tiers_shared_sightings_total",
                           "L3 offer-marker sightings: seen on another instance, or not shared (by reason)",
                           ("outcome",))


def count_unshared(t: Any) -> Callable[[str, int], None]:
    def count(reason: str, n: int) -> None:
        t.count("sightings_unshared", n)
        m_sightings().labels(reason).inc(n)

    return count


class MooncakeMarkers:
    """Offer markers as one-byte objects next to the pages (`SharedSightings`' store calls);
    keyed like the page records, with the namespace digest, so other layouts do not count. Holds
    its backend (a `KllmMooncakeStorage`) weakly."""

    _VALUE = b"\x01"

    def __init__(self, backend: Any) -> None:
        self._backend = weakref.ref(backend)

    @property
    def backend(self) -> Any:
        b = self._backend()
        if b is None or not b.ready:
            raise RuntimeError("store not attached")
        return b

    def _keys(self, keys: list[str]) -> list[str]:
        b = self.backend
        ns = b.namespace_digest[:4].hex()
        return [f"{k}_{b.mha_suffix}_kllm_seen_{ns}" for k in b._tag_keys(keys)]

    def exists(self, keys: list[str]) -> list[int]:
        return list(self.backend.store.batch_is_exist(self._keys(keys)))

    def mark(self, keys: list[str]) -> bool:
        return self.backend.store.put_batch(self._keys(keys), [self._VALUE] * len(keys)) == 0

    def unmark(self, keys: list[str]) -> None:
        self.backend.store.batch_remove(self._keys(keys), True)  # force: a marker just checked holds a lease
