"""Layer: plugin core (no SGLang import). Pages held back while persistence is dormant.

A dormant policy (no reuse seen yet: after a start, or a workload of one-off prompts) writes
nothing to L3, so a workload without reuse never pays for L3 writes. The price was paid by
workloads *with* reuse: the pages offered before the first sign of reuse (a conversation's first
turn, which its second turn, landing on another instance, would read from L3) were dropped, and
their second turns recomputed them. `HeldPages` keeps a bounded copy of the most recent such pages
in memory; once reuse is seen they are written (oldest first), and while it is not they are only
replaced by newer ones. Nothing reaches L3 before reuse is seen; the cost without reuse is one
copy of each skipped page into a bounded buffer (`max_bytes`, least recent dropped first).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from kllm_plugins.plugins.kv_tiers.core.page_format import nbytes_of


class HeldPages:
    """Bounded FIFO of (key, page bytes); a key held twice keeps one copy."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._pages: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.held = 0
        self.dropped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def hold(self, key: str, data: bytes | memoryview, owned: bool = False) -> bool:
        """Keep a copy of a skipped page (`owned`: `data` is already a copy no one else writes, kept
        as is); False when it cannot fit at all (larger than the bound)."""
        n = nbytes_of(data)
        if n > self.max_bytes:
            return False
        page = data if owned else bytes(data)
        with self._lock:
            old = self._pages.pop(key, None)
            if old is not None:
                self._bytes -= nbytes_of(old)
            while self._pages and self._bytes + n > self.max_bytes:
                _, gone = self._pages.popitem(last=False)
                self._bytes -= nbytes_of(gone)
                self.dropped += 1
            self._pages[key] = page
            self._bytes += n
            self.held += 1
        return True

    def take_all(self) -> list[tuple[str, bytes | memoryview]]:
        """Every held page, oldest first; the buffer is empty afterwards."""
        with self._lock:
            out = list(self._pages.items())
            self._pages.clear()
            self._bytes = 0
        return out
