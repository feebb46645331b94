"""Layer: plugin core (no SGLang import). Cache events for the L2 and L3 tiers.

SGLang publishes `BlockStored` / `BlockRemoved` events for GPU (L1) and host (L2) pages only;
nothing says when a page reaches or leaves L3, nor which instance holds it. This module
records those events in SGLang's own wire shape, extended by optional fields, so a consumer
that decodes SGLang's format keeps working (msgspec ignores unknown fields) and one that knows
the extension can route by tier and instance:

    {"type": "BlockStored", "block_hashes": [int64, ...], "parent_block_hash": int64 | null,
     "token_ids": [], "block_size": page_size, "lora_id": null,
     "medium": "DISK" | "EXTERNAL" | "CPU_PINNED",
     "instance_id": "host:port",          # extension
     "storage_keys": ["<hex>", ...]}      # extension: the L3 keys, same order as block_hashes
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "DISK", "instance_id": "...",
     "storage_keys": [...]}

`block_hashes` use SGLang's own mapping from a page's chained SHA-256 (the HiCache storage key)
to a signed int64 (the first 16 hex digits), so an L3 event names the same block as the L1/L2
events of the same page. `token_ids` is empty: the store sees keys, not tokens.
"""
from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

Medium = Literal["CPU_PINNED", "DISK", "EXTERNAL"]
Kind = Literal["stored", "removed"]

_HEX16 = re.compile(r"^[0-9a-fA-F]{16}")


def key_to_block_hash(key: str) -> int:
    """SGLang's int64 event hash of a storage key; a key that is not hex is hashed first."""
    if not _HEX16.match(key):
        key = hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()
    v = int(key[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass(frozen=True)
class TierEvent:
    kind: Kind
    medium: Medium
    keys: tuple[str, ...]
    instance_id: str
    block_size: int
    ts: float = field(default_factory=time.time)

    def to_wire(self) -> dict[str, Any]:
        hashes = [key_to_block_hash(k) for k in self.keys]
        if self.kind == "stored":
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": self.block_size,
                "lora_id": None,
                "medium": self.medium,
                "instance_id": self.instance_id,
                "storage_keys": list(self.keys),
            }
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": self.medium,
            "instance_id": self.instance_id,
            "storage_keys": list(self.keys),
        }


class TierEventLog:
    """Thread-safe, bounded buffer of tier events (the oldest are dropped and counted).

    Consecutive events of the same kind and medium are merged into one, up to `max_keys_per_event`
    keys, which keeps a burst of single-page writes to one event per batch.
    """

    def __init__(self, instance_id: str, block_size: int, max_events: int = 10_000,
                 max_keys_per_event: int = 256) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        self.max_keys_per_event = max_keys_per_event
        self._events: deque[TierEvent] = deque()
        self.max_events = max_events
        self.dropped = 0
        self.recorded = 0
        self._lock = threading.Lock()

    def record(self, kind: Kind, medium: Medium, keys: list[str] | tuple[str, ...]) -> None:
        if not keys:
            return
        with self._lock:
            self.recorded += len(keys)
            last = self._events[-1] if self._events else None
            if (last is not None and last.kind == kind and last.medium == medium
                    and len(last.keys) + len(keys) <= self.max_keys_per_event):
                self._events[-1] = TierEvent(kind, medium, last.keys + tuple(keys), self.instance_id,
                                             self.block_size, last.ts)
                return
            self._events.append(TierEvent(kind, medium, tuple(keys), self.instance_id, self.block_size))
            while len(self._events) > self.max_events:
                dropped = self._events.popleft()
                self.dropped += len(dropped.keys)

    def take(self) -> list[TierEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
