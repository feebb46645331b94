"""Layer: SGLang adapter of the incr_prefix plugin (waiting-queue re-match memo). Imports SGLang.

Cache-aware schedule policies (lpm, dfs-weight, shortest-prefill-first) re-match every waiting
request against the radix tree on every scheduler pass
(`SchedulePolicy._compute_prefix_matches` -> `match_kv_cache` -> `match_prefix`), even when
nothing that could change the answer happened since the previous pass. This module keeps, per
waiting request, the previous result and answers from it when it provably still holds:

* same request tokens: the key is built from `origin_input_ids + output_ids` at that call site;
  SGLang replaces `origin_input_ids` (abort) and only appends to `output_ids`, so identity and
  lengths of both arrays, the key length and its namespace fields identify the key in O(1);
* same tree epoch (bumped by `reset`);
* the node the match ended on is still alive (not evicted, still attached). A node keeps its
  end depth when another request splits its path (the split node goes above it), and eviction
  removes leaves first, so an alive node still spells the matched prefix;
* the match cannot have grown: either the key is exhausted there or the node has no child
  starting with the key's next page (the O(1) dictionary test the walk itself would do first).

On a hit it still does the one thing the stock match does to the tree: the LRU stamp of the
matched node and its ancestors (`_match_post_processor`), with the same clock tick, so eviction
order stays stock's. Only on the Python TreeCore without HiCache, sessions or auxiliary
components (the Rust binding has no node-level touch, so a skipped match there would change LRU
order). Active only inside the waiting-queue pass, which the AROUND hook on
`_compute_prefix_matches` marks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sglang.srt.mem_cache.unified_cache.components.base import get_and_increase_time_counter

MEMO_ATTR = "_kllm_wq_match"


@dataclass
class MatchMemo:
    sig: tuple[Any, ...]
    epoch: int
    node: Any
    result: Any


def _signature(req: Any, key: Any) -> tuple[Any, ...]:
    return (
        id(req.origin_input_ids), len(req.origin_input_ids), id(req.output_ids), len(req.output_ids),
        len(key), key.extra_key, key.cache_salt, key.is_bigram,
    )


def memo_match(cache: Any, params: Any, stock_match: Callable[[Any], Any]) -> Any:
    """`cache.match_prefix(params)` for a waiting-queue pass, answered from the memo when the
    previous result provably still holds; otherwise the stock match, memoized."""
    req = params.req
    key = params.key
    counters = cache.kllm_counters
    tc = cache.tree_core
    sig = _signature(req, key)
    memo: MatchMemo | None = getattr(req, MEMO_ATTR, None)
    if memo is not None and memo.sig == sig and memo.epoch == cache.kllm_epoch:
        node = memo.node
        root = tc.root_node
        alive = node is root or (
            tc._node_arena.get(node.id) is node and node.parent is not None and not node.evicted
        )
        if alive:
            depth = memo.result.device_prefix_len
            aligned = key.page_aligned(cache.page_size)
            grown = depth < len(aligned) and aligned.child_key_at(depth, cache.page_size) in node.children
            if not grown:
                # `_match_post_processor`'s LRU stamp, exactly: one tick, then down the parents.
                now = get_and_increase_time_counter()
                cur = node
                while cur:
                    cur.last_access_time = now
                    now -= 0.00001
                    cur = cur.parent
                counters.rematch_skipped += 1
                return memo.result
    result = stock_match(params)
    counters.rematch_done += 1
    # An empty (page-aligned) key returns without touching the tree: never memoize it.
    if len(key.page_aligned(cache.page_size)) > 0 and result.best_match_node == result.last_device_node:
        node = tc._node_arena.get(result.last_device_node)
        if node is not None:
            setattr(req, MEMO_ATTR, MatchMemo(sig=sig, epoch=cache.kllm_epoch, node=node, result=result))
    return result


def around_compute_prefix_matches(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `SchedulePolicy._compute_prefix_matches`: mark the waiting-queue pass on our cache."""
    cache = self.tree_cache
    if not hasattr(cache, "kllm_wq_pass"):
        return original(self, *args, **kwargs)
    cache.kllm_wq_pass = True
    try:
        return original(self, *args, **kwargs)
    finally:
        cache.kllm_wq_pass = False
