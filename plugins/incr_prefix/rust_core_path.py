"""Layer: SGLang adapter of the incr_prefix plugin (Rust TreeCore path). Imports SGLang.

SGLang's Rust TreeCore (the serving default) takes an insert only as a whole key from the root
(`RustUnifiedTreeCoreBinding.begin_insert`); there is no entry that starts at a node. So on that
core the tree walk itself stays O(prefix) per chunk. What this module removes is everything
around the walk that stock `checkpoint_into_tree` also redoes from token 0 on every chunk:

* the key: stock slices `full_untruncated_fill_ids[:up_to]` and then the RadixKey again (two
  copies of the whole prefix); here a per-request key array is extended by the new tail only
  and handed to the binding as is (`RadixKey.raw_token_ids` returns it without a copy);
* the value: stock copies `req_to_token[row, :n]` to a fresh int64 tensor; here a per-request
  int64 mirror of the row is extended by the tail only (and kept equal to the row where the
  checkpoint rewrites it with the tree's indices), and a view of it is passed;
* the new indices: stock collects the device indices of the whole root-to-leaf path
  (`path_device_indices`); here only the nodes below the previously locked node
  (`collect_full_device_indices(new, anchor)`), checked against the expected tail length.

The binding receives exactly the key, value and parameters stock passes, so the tree, locks,
sizes and events are stock's. Anything outside the plain case (finish, prompt split, rotation,
components, HiCache...) goes to the stock method, counted by reason like the Python path.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from kllm_plugins.plugins.incr_prefix.core.walk_state import Reason

RUST_REQ_ATTR = "_kllm_incr_rust"


@dataclass
class RustTailState:
    """Per-request state between two checkpoints on the Rust TreeCore.

    anchor: the node id the request's previous checkpoint ended on (and locked).
    depth:  tokens on the root-to-anchor path (== cache_protected_len then).
    epoch:  the cache's reset epoch at save time.
    fill:   the request's `full_untruncated_fill_ids` object the key was copied from; SGLang
            replaces (never rewrites) it on retraction or abort, so identity detects that.
    keys:   the request's first `depth` tokens, as the binding wants them (int64 array);
            None until the first tail checkpoint.
    values: int64 mirror of `req_to_token[row, :depth]` (capacity may be larger); None until
            the first tail checkpoint.
    """

    anchor: Any
    depth: int
    epoch: int
    fill: Any
    keys: array | None = None
    values: torch.Tensor | None = None


def route(cache: Any, req: Any, up_to: int, kwargs: dict[str, Any]) -> Reason | None:
    """None when the Rust tail path serves this checkpoint, else why stock must."""
    if not cache.kllm_config.enabled:
        return Reason.DISABLED
    if kwargs:
        return Reason.UNSUPPORTED_CACHE
    if req.kv_rotation_base is not None:
        return Reason.ROTATION
    if req.finished():
        return Reason.FINISH
    state: RustTailState | None = getattr(req, RUST_REQ_ATTR, None)
    if state is None:
        return Reason.NO_STATE
    lock = req.lock
    if (
        state.epoch != cache.kllm_epoch
        or state.anchor != req.last_node
        or lock is None
        or lock.node != req.last_node
        or state.depth != req.kv.cache_protected_len
        or state.fill is not req.full_untruncated_fill_ids
    ):
        return Reason.STALE
    if state.depth < cache.kllm_config.min_prefix_tokens:
        return Reason.SHORT
    aligned = up_to - up_to % cache.page_size
    if aligned <= state.depth:
        return Reason.SHORT
    prompt = len(req.origin_input_ids)
    if aligned > prompt - prompt % cache.page_size:
        # Stock follows with a prompt-boundary insert (output past the prompt): leave it stock.
        return Reason.PROMPT_SPLIT
    return None


def save_state(cache: Any, req: Any, up_to: int) -> None:
    """After a stock checkpoint on the Rust core: remember where it ended. The key array and
    value mirror are built on the first tail checkpoint (one copy of the prefix, as stock makes
    on every chunk), so a request prefilled in one chunk pays for nothing but this record."""
    lock = req.lock
    depth = req.kv.cache_protected_len
    if req.finished() or lock is None or lock.node != req.last_node or depth <= 0 or up_to >= len(req.origin_input_ids):
        # Finished, unlocked, or the prompt is complete: the next checkpoint is stock anyway.
        setattr(req, RUST_REQ_ATTR, None)
        return
    setattr(
        req,
        RUST_REQ_ATTR,
        RustTailState(anchor=req.last_node, depth=depth, epoch=cache.kllm_epoch, fill=req.full_untruncated_fill_ids),
    )


def checkpoint_tail(cache: Any, req: Any, up_to: int) -> None:
    """Stock `checkpoint_into_tree` for an unfinished FULL-only request on the Rust core, with
    the key, value and new-index work done for the tail only. `route` returned None."""
    state: RustTailState = getattr(req, RUST_REQ_ATTR)
    start = state.depth
    aligned = up_to - up_to % cache.page_size
    row = req.kv.req_pool_idx
    pool = cache.req_to_token_pool

    params = InsertParams(
        prev_prefix_len=start,
        inserted_len=req.kv.cache_inserted_len,
        priority=req.priority or 0,
        session_id=req.session_id,
        rotation_base=None,
    )
    effective = up_to
    for comp in cache._components_tuple:
        cl = comp.prepare_for_caching_req(req=req, insert_params=params, token_ids_len=up_to, is_finished=False)
        if cl is not None:
            effective = min(effective, cl)
    for comp in cache._components_tuple:
        effective = comp.floor_cache_len(effective)
    assert effective == up_to, f"FULL-only cache shortened the key: {effective} < {up_to}"

    if state.keys is None:
        state.keys = state.fill[:start]
        state.values = torch.empty(max(aligned, len(req.origin_input_ids)), dtype=torch.int64)
        state.values[:start] = pool.req_to_token[row, :start]
    keys = state.keys
    keys.extend(state.fill[start:aligned])
    values = state.values
    if values.shape[0] < aligned:
        grown = torch.empty(max(aligned, 2 * values.shape[0]), dtype=torch.int64)
        grown[:start] = values[:start]
        values = state.values = grown
    values[start:aligned] = pool.req_to_token[row, start:aligned]

    params.key = RadixKey(keys, req.extra_key, is_bigram=False, cache_salt=req.cache_salt)
    # The binding reads the value; it is not kept (checked by the property tests, which
    # rewrite the mirror after every insert and compare the tree with stock's).
    params.value = values[:aligned]
    if envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get():
        for comp in cache._components_tuple:
            comp.free_out_of_window_slots(req, aligned - 1, params)
    result = cache.insert(params)
    req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, aligned)

    new_last_node = result.last_device_node
    tail = cache.tree_core.collect_full_device_indices(new_last_node, state.anchor)
    if start + len(tail) != aligned:
        # The anchor is not where the path passes (cannot happen while it is locked); stay exact.
        full = cache.path_device_indices(new_last_node)
        assert len(full) == aligned, f"{len(full)=}, {aligned=}"
        tail = full[start:]
    assert result.prefix_len <= aligned, f"{result.prefix_len=}, {aligned=}"
    pool.write((row, slice(start, aligned)), tail)
    values[start:aligned] = tail

    cache.unlock(req.lock)
    req.lock = cache.lock(
        new_last_node,
        skip_lock_components=(ComponentType.MAMBA,) if envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.get() else (),
    )
    req.kv.cache_protected_len = aligned
    req.last_node = new_last_node
    for comp in cache._components_tuple:
        comp.cleanup_after_caching_req(req, is_finished=False, insert_result=result, insert_params=params)
    state.anchor = new_last_node
    state.depth = aligned
