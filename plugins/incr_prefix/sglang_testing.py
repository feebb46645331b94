"""Layer: SGLang adapter, test support. Drives real SGLang caches the way the scheduler does.

Imported only by the plugin's tests and benchmarks (never by the server path). It reproduces
the scheduler's calls around chunked prefill with SGLang's own functions: admission
(`Req.init_next_round_input` -> `match_kv_cache`, then the lock the prefill adder takes), one
`checkpoint` per chunk (what `stash_chunked_request` -> `checkpoint_kv_cache` does), finish
(`release_kv_cache(checkpoint=True)`), abort (`release_kv_cache(checkpoint=False)`) and
retraction (`release_kv_cache(checkpoint=False)` then `Req.reset_for_retract`).
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class Running:
    """One admitted request and how far its prefill has got."""

    req: Any
    done: int
    outputs: list[int] = field(default_factory=list)


class CacheDriver:
    """The scheduler's side of one cache: a request pool, a KV allocator and a tree."""

    def __init__(self, cache: Any, allocator: Any, pool: Any) -> None:
        self.cache = cache
        self.allocator = allocator
        self.pool = pool
        self.last_tree_s = 0.0
        """Seconds the last extend/finish spent in the tree call alone (for benchmarks)."""

    def _alloc(self, n: int) -> Any:
        if n <= 0:
            return self.allocator.alloc(0) if n == 0 else None
        if self.allocator.available_size() < n:
            self.cache.evict(EvictParams(num_tokens=n - self.allocator.available_size()))
        if self.allocator.available_size() < n:
            return None
        return self.allocator.alloc(n)

    def admit(self, rid: str, tokens: list[int] | array) -> Running | None:
        """Match the prompt against the tree and lock the hit, as admission does."""
        req = Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1 << 20),
        )
        return self.readmit(Running(req, 0))

    def readmit(self, run: Running) -> Running | None:
        req = run.req
        if not self.pool.available_size():
            return None
        req.refresh_fill_ids()
        req.init_next_round_input(self.cache)
        self.pool.alloc([req])
        prefix = req.prefix_len
        if prefix:
            self.pool.write((req.kv.req_pool_idx, slice(0, prefix)), self.cache.path_device_indices(req.last_node))
        req.kv.kv_committed_len = prefix
        req.kv.kv_allocated_len = prefix
        req.lock = self.cache.lock(req.last_node)
        run.done = prefix
        return run

    def extend(self, run: Running, n: int) -> bool:
        """Compute the next `n` prompt tokens (allocate their KV) and checkpoint them, as the
        scheduler does between chunks. False when the KV pool cannot hold them."""
        req = run.req
        end = min(len(req.origin_input_ids), run.done + n)
        kv = self._alloc(end - run.done)
        if kv is None:
            return False
        self.pool.write((req.kv.req_pool_idx, slice(run.done, end)), kv)
        req.kv.kv_committed_len = end
        req.kv.kv_allocated_len = end
        req.extend_end = end
        t0 = time.perf_counter()
        checkpoint_kv_cache(req, self.cache)
        self.last_tree_s = time.perf_counter() - t0
        run.done = end
        return True

    def decode(self, run: Running, token: int) -> bool:
        """One output token (its KV allocated, nothing inserted: decode does not checkpoint)."""
        req = run.req
        kv = self._alloc(1)
        if kv is None:
            return False
        pos = len(req.origin_input_ids) + len(run.outputs)
        self.pool.write((req.kv.req_pool_idx, slice(pos, pos + 1)), kv)
        run.outputs.append(token)
        req.output_ids.append(token)
        req.kv.kv_committed_len = pos + 1
        req.kv.kv_allocated_len = pos + 1
        return True

    def finish(self, run: Running) -> None:
        run.req.finished_reason = FINISH_LENGTH(length=len(run.outputs))
        t0 = time.perf_counter()
        release_kv_cache(run.req, self.cache, checkpoint=True)
        self.last_tree_s = time.perf_counter() - t0

    def abort(self, run: Running) -> None:
        run.req.finished_reason = FINISH_ABORT()
        release_kv_cache(run.req, self.cache, checkpoint=False)

    def retract(self, run: Running) -> None:
        release_kv_cache(run.req, self.cache, checkpoint=False)
        run.req.reset_for_retract()
        run.outputs.clear()
        del run.req.output_ids[:]
        run.done = 0

    def match_len(self, tokens: list[int]) -> int:
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len


def tree_snapshot(cache: Any) -> dict[str, Any]:
    """Everything observable about a Python-TreeCore tree, independent of node ids and of the
    process-wide access clock: per node (keyed by its token path) its value, lock count,
    priority, hit count and eviction flag, plus the nodes ordered by last access and the
    cache's size counters. For the Rust TreeCore, see `rust_tree_snapshot`."""
    tc = cache.tree_core
    if type(tc).__name__ == "RustUnifiedTreeCore":
        return rust_tree_snapshot(cache)
    nodes: dict[tuple[int, ...], tuple[Any, ...]] = {}
    by_time: list[tuple[float, tuple[int, ...]]] = []
    stack = [(tc.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            cpath = path + tuple(child.key.token_ids[: len(child.key)])
            data = child.component_data[ComponentType.FULL]
            value = None if data.value is None else tuple(data.value.tolist())
            nodes[cpath] = (value, data.lock_ref, child.priority, child.hit_count, child.evicted)
            by_time.append((child.last_access_time, cpath))
            stack.append((child, cpath))
    by_time.sort()
    paths = {id(n): p for p, n in _nodes_by_path(tc)}
    return {
        "evictable_leaves": sorted(paths[id(n)] for n in tc.evictable_device_leaves),
        "nodes": nodes,
        "lru_order": [p for _, p in by_time],
        "evictable": cache.evictable_size(),
        "protected": cache.protected_size(),
        "free_kv": cache.token_to_kv_pool_allocator.available_size(),
    }


def _nodes_by_path(tc: Any) -> list[tuple[tuple[int, ...], Any]]:
    out = [((), tc.root_node)]
    i = 0
    while i < len(out):
        path, node = out[i]
        for child in node.children.values():
            out.append((path + tuple(child.key.token_ids[: len(child.key)]), child))
        i += 1
    return out


def rust_tree_snapshot(cache: Any) -> dict[str, Any]:
    """What the Rust TreeCore's binding lets one observe: its own tree dump (node ids, key
    lengths, lock counts, device residency; printed by Rust to fd 1, captured here), every
    device value in tree order, the unlocked slots and positions, and the size counters. Two
    caches that issued the same binding calls in the same order give equal snapshots."""
    import os
    import sys
    import tempfile

    binding = cache.tree_core._binding
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            binding.pretty_print()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        dump = tmp.read().decode()
    nodes: dict[int, tuple[Any, ...]] = {}
    stack: list[tuple[int, int]] = []  # (indent, node id)
    for line in dump.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        fields = line.split()
        node_id, key_len, rest = int(fields[0].strip("[]")), int(fields[1]), tuple(fields[2:])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else None
        value = binding.get_component_device_value(node_id, int(ComponentType.FULL))
        nodes[node_id] = (parent, key_len, rest, None if value is None else tuple(value.tolist()))
        stack.append((indent, node_id))
    walk = binding.walk_for_kv_canary(True, False)
    return {
        # Children are printed in hash-map order, so nodes are compared by id, not by line.
        "nodes": nodes,
        "unlocked_slots": sorted(walk.slot_indices.tolist()),
        "evictable": cache.evictable_size(),
        "protected": cache.protected_size(),
        "free_kv": cache.token_to_kv_pool_allocator.available_size(),
    }
