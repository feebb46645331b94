"""Layer: core (no SGLang import). Which instance holds which KV blocks, from their KV events.

SGLang instances started with `--kv-events-config` publish `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` events for their cache, each block tagged with the medium it lives on
(`GPU`, `CPU_PINNED`; with the kv_tiers plugin also `DISK` / `EXTERNAL` for L3). This index
keeps, per instance, the set of blocks and media it holds, so the router can ask: of this
prompt's leading blocks, how many does each instance hold, and where?

Block identity: the engine's own block hashes are opaque (they may be namespaced by LoRA or
cache salt), so the index keys blocks by its own chained hash of the block's token ids,
(parent key, tokens) -> key, learnt from `BlockStored` events that carry token ids, and keeps
the engine hash -> key map to apply later events that name blocks only by engine hash (removals,
and the L3 events of kv_tiers, which carry no token ids). A prompt is looked up by chaining the
same hash over its token ids at the instance's block size.

A block on the GPU is worth more than the same block in host memory or on disk (it must be
loaded back first): `MEDIUM_WEIGHT` turns a match into "effectively cached" blocks.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

log = logging.getLogger("kllm.bigpd_router.kv_index")

MEDIUM_WEIGHT = {"GPU": 1.0, "CPU_PINNED": 0.6, "CPU": 0.6, "DISK": 0.3, "EXTERNAL": 0.3}
"""How much of a prefill a block saves on each medium (GPU: all of it; L2/L3: it must be loaded)."""
DEFAULT_MEDIUM = "GPU"
MAX_LOOKUP_BLOCKS = 4096
"""Lookups walk at most this many leading blocks (bounded cost per request)."""


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


@dataclass
class InstanceBlocks:
    block_size: int = 0
    media: dict[int, set[str]] = field(default_factory=dict)
    """index key -> media holding the block"""
    engine_to_key: dict[int, int] = field(default_factory=dict)
    events: int = 0
    unknown: int = 0
    """Events that named a block the index never saw stored with its tokens (ignored)."""

    def _drop(self, key: int, medium: str | None) -> None:
        held = self.media.get(key)
        if held is None:
            return
        if medium is None:
            held.clear()
        else:
            held.discard(medium)
        if not held:
            del self.media[key]


class KvIndex:
    """Per-instance block index fed by KV events; thread-safe (events may arrive from a thread)."""

    def __init__(self, max_blocks_per_instance: int = 2_000_000) -> None:
        self.max_blocks_per_instance = max_blocks_per_instance
        self._by_url: dict[str, InstanceBlocks] = {}
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """True once any instance has published at least one event."""
        return bool(self._by_url)

    def publishing(self, url: str) -> bool:
        return url in self._by_url

    def block_size(self, url: str) -> int:
        blocks = self._by_url.get(url)
        return blocks.block_size if blocks else 0

    def apply(self, url: str, events: Iterable[dict[str, Any]], block_size: int = 0) -> None:
        """Apply decoded events (tagged maps: {"type": "BlockStored", ...}) published by `url`."""
        with self._lock:
            inst = self._by_url.setdefault(url, InstanceBlocks(block_size=block_size))
            for ev in events:
                inst.events += 1
                kind = ev.get("type")
                if kind == "BlockStored":
                    self._stored(inst, ev)
                elif kind == "BlockRemoved":
                    medium = ev.get("medium") or DEFAULT_MEDIUM
                    for h in ev.get("block_hashes") or ():
                        key = inst.engine_to_key.get(h)
                        if key is None:
                            inst.unknown += 1
                            continue
                        inst._drop(key, medium)
                        if key not in inst.media:
                            inst.engine_to_key.pop(h, None)
                elif kind == "AllBlocksCleared":
                    inst.media.clear()
                    inst.engine_to_key.clear()

    def _stored(self, inst: InstanceBlocks, ev: dict[str, Any]) -> None:
        hashes = ev.get("block_hashes") or []
        tokens = ev.get("token_ids") or []
        medium = ev.get("medium") or DEFAULT_MEDIUM
        size = int(ev.get("block_size") or inst.block_size or 0)
        if size > 0:
            inst.block_size = size
        if tokens and size > 0 and len(tokens) >= len(hashes) * size:
            parent_hash = ev.get("parent_block_hash")
            parent = 0
            if parent_hash is not None:
                got = inst.engine_to_key.get(parent_hash)
                if got is None:  # the parent was stored before we subscribed: the chain cannot be placed
                    inst.unknown += 1
                    return
                parent = got
            for i, h in enumerate(hashes):
                parent = chain_key(parent, tokens[i * size:(i + 1) * size])
                inst.engine_to_key[h] = parent
                inst.media.setdefault(parent, set()).add(medium)
        else:  # no tokens (e.g. an L3 copy of a block): known blocks only gain a medium
            for h in hashes:
                key = inst.engine_to_key.get(h)
                if key is None:
                    inst.unknown += 1
                    continue
                inst.media.setdefault(key, set()).add(medium)
        if len(inst.media) > self.max_blocks_per_instance:  # should not happen with a live feed; stay bounded
            log.warning("kv index over %d blocks; cleared", self.max_blocks_per_instance)
            inst.media.clear()
            inst.engine_to_key.clear()

    def match(self, token_ids: Sequence[int], urls: Iterable[str]) -> dict[str, float]:
        """url -> fraction of the prompt's whole blocks that instance holds as a leading run, each block
        weighted by its best medium. Only instances that publish appear in the answer."""
        out: dict[str, float] = {}
        keys_by_size: dict[int, list[int]] = {}
        with self._lock:
            for url in urls:
                inst = self._by_url.get(url)
                if inst is None or inst.block_size <= 0:
                    continue
                size = inst.block_size
                keys = keys_by_size.get(size)
                if keys is None:
                    keys = keys_by_size[size] = _keys(token_ids, size)
                if not keys:
                    out[url] = 0.0
                    continue
                weight = 0.0
                for key in keys:
                    held = inst.media.get(key)
                    if not held:
                        break
                    weight += max(MEDIUM_WEIGHT.get(m, 0.3) for m in held)
                out[url] = weight / len(keys)
        return out

    def forget(self, url: str) -> None:
        with self._lock:
            self._by_url.pop(url, None)

    def summary(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {url: {"blocks": len(b.media), "events": b.events, "unknown": b.unknown,
                          "block_size": b.block_size} for url, b in self._by_url.items()}


def _keys(token_ids: Sequence[int], size: int) -> list[int]:
    keys = []
    parent = 0
    n = min(len(token_ids) // size, MAX_LOOKUP_BLOCKS)
    for i in range(n):
        parent = chain_key(parent, token_ids[i * size:(i + 1) * size])
        keys.append(parent)
    return keys
