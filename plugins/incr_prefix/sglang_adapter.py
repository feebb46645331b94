"""Layer: SGLang adapter of the incr_prefix plugin. The only module of the plugin that imports SGLang.

`IncrementalUnifiedRadixCache` is SGLang's `UnifiedRadixCache` with one method changed:
`checkpoint_into_tree`, which stock SGLang runs after every prefill chunk and which re-inserts the
request's whole prefix from the root. When the request's saved walk state is still valid, the
subclass inserts only the new tail under the node the previous chunk locked, then touches the
already-protected path exactly as the stock walk would (LRU times, priorities, hit counts), so the
tree it leaves is the one stock SGLang leaves. Anything it does not reproduce goes to the stock
method and is counted (see `core.walk_state.Reason`).

The cache is installed through SGLang's radix-cache registry (`--radix-cache-backend
kllm_incremental`), built by `create_unified_radix_cache(ctx, cache_class=...)` so HiCache and
component wiring stay SGLang's. The tail walk drives the Python TreeCore's resumable insert
(`_InsertWalkState`, `_advance_insert`). The Rust TreeCore's binding has no insert-from-node
entry: there the walk stays whole and `rust_core_path` makes the work around it tail-only.
"""
from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    TreeLock,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import BASE_COMPONENT_TYPE, ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import get_and_increase_time_counter
from sglang.srt.mem_cache.unified_cache.unified_tree_core import (
    UnifiedTreeCore,
    _InsertPhase,
    _InsertWalkState,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kllm_plugins.plugins.incr_prefix import rust_core_path, waiting_match_memo
from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
from kllm_plugins.plugins.incr_prefix.core.walk_state import (
    IncrCounters,
    Observed,
    Reason,
    WalkState,
    check_state,
    prompt_touch_depth,
)

logger = logging.getLogger("kllm.incr_prefix")

BACKEND_NAME = "kllm_incremental"
# UnifiedTreeCore methods the tail path calls or stands in for (begin_insert: it builds the walk
# state itself; _touch_node/_inc_hit_count_and_check: the prefix touch it reproduces)
_TAIL_PATH_CORE_METHODS = (
    "begin_insert", "_advance_insert", "resume_insert", "end_insert", "has_ongoing_insert",
    "_insert_walk_step", "_insert_overlap_step", "_finish_insert_walk_node", "_insert_commit_step",
    "_insert_tail_step", "_split_node", "_touch_node", "_inc_hit_count_and_check",
    "_build_backup_kv_action", "_update_evictable_leaf_sets", "match_prefix",
    "collect_full_device_indices", "node_by_id", "inc_lock_ref", "dec_lock_ref",
)
_REQ_ATTR = "_kllm_incr_state"


class IncrementalUnifiedRadixCache(UnifiedRadixCache):
    """UnifiedRadixCache whose chunk checkpoints insert only the new tail when that is safe."""

    kllm_config: IncrPrefixConfig = IncrPrefixConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kllm_epoch = 0
        self.kllm_counters = IncrCounters()
        self.kllm_observer: Any = None
        self._kllm_rust = False
        self.kllm_wq_pass = False
        super().__init__(*args, **kwargs)
        self._kllm_rust = type(self.tree_core).__name__ == "RustUnifiedTreeCore"
        self._kllm_unsupported = self._static_unsupported()
        if self._kllm_unsupported:
            logger.info("incr_prefix: tail-only inserts off for this cache: %s", self._kllm_unsupported)

    # ---- routing ----

    def _static_unsupported(self) -> str:
        """Features fixed at construction that the tail path does not reproduce ('' if none)."""
        if self.disable:
            return "cache disabled"
        if not self._kllm_rust:
            core_cls = type(self.tree_core)
            if not isinstance(self.tree_core, UnifiedTreeCore):
                return f"TreeCore {core_cls.__name__} is not supported"
            # a subclass that only adds methods (SGLang's test-kit inspector) walks as the Python
            # core; one that overrides a method the tail path drives or reproduces does not
            changed = [m for m in _TAIL_PATH_CORE_METHODS if getattr(core_cls, m) is not getattr(UnifiedTreeCore, m)]
            if changed:
                return f"TreeCore {core_cls.__name__} overrides {', '.join(changed)}"
        comps = self._components_tuple
        if len(comps) != 1 or comps[0].component_type != BASE_COMPONENT_TYPE:
            return "auxiliary components (SWA/Mamba)"
        # HiCache: the Rust path keeps SGLang's own insert (write-through actions included) and
        # only builds its arguments incrementally, so it stays on; the Python tail walk does not
        # reproduce HiCache's per-node host bookkeeping.
        if not self._kllm_rust and (self.cache_controller is not None or getattr(self.tree_core, "enable_hicache", False)):
            return "HiCache"
        if self.linker is not None:
            return "external cache linker"
        if self.enable_session_radix_cache:
            return "session radix cache"
        if self.tree_core.is_eagle:
            return "EAGLE bigram keys"
        return ""

    # HiCache and the external linker are attached after construction
    # (`create_unified_radix_cache`): re-decide then.
    def init_hicache(self, *args: Any, **kwargs: Any) -> Any:
        out = super().init_hicache(*args, **kwargs)
        self._kllm_unsupported = self._static_unsupported()
        if self._kllm_unsupported:
            logger.info("incr_prefix: tail-only inserts off for this cache: %s", self._kllm_unsupported)
        return out

    def init_cache_linker(self, *args: Any, **kwargs: Any) -> Any:
        out = super().init_cache_linker(*args, **kwargs)
        self._kllm_unsupported = self._static_unsupported()
        if self._kllm_unsupported:
            logger.info("incr_prefix: tail-only inserts off for this cache: %s", self._kllm_unsupported)
        return out

    def reset(self) -> None:
        # Nodes are rebuilt: every saved walk state must fail its epoch check.
        self.kllm_epoch = getattr(self, "kllm_epoch", 0) + 1
        super().reset()

    def match_prefix(self, params: Any) -> Any:
        # Inside a waiting-queue pass (marked by the AROUND hook on _compute_prefix_matches) the
        # key is the request's origin + output ids: a re-match may be answered from its memo.
        if (
            self.kllm_wq_pass
            and params.req is not None
            and not self._kllm_unsupported
            and not self._kllm_rust
            and self.kllm_config.enabled
            and self.kllm_config.waiting_match_memo
            and not params.cow_mamba
        ):
            return waiting_match_memo.memo_match(self, params, super().match_prefix)
        return super().match_prefix(params)

    def _route(self, req: Any, up_to: int, kwargs: dict[str, Any]) -> tuple[Reason | None, int | None]:
        """(None, prompt_touch) when the tail path serves this checkpoint, else (reason, None)."""
        if not self.kllm_config.enabled:
            return Reason.DISABLED, None
        if self._kllm_unsupported or kwargs:
            return Reason.UNSUPPORTED_CACHE, None
        if req.kv_rotation_base is not None:
            return Reason.ROTATION, None
        saved = getattr(req, _REQ_ATTR, None)
        state, anchor = saved if saved is not None else (None, None)
        lock = req.lock
        node = self.tree_core._node_arena.get(req.last_node)
        seen = Observed(
            last_node=req.last_node,
            locked_node=lock.node if lock is not None else None,
            protected_len=req.kv.cache_protected_len,
            epoch=self.kllm_epoch,
            # Identity, not just id: a node freed and re-created under a reused id is stale.
            node_alive=node is not None
            and node is anchor
            and (node is self.tree_core.root_node or (node.parent is not None and not node.evicted)),
        )
        reason = check_state(state, seen)
        if reason is not None:
            return reason, None
        start = req.kv.cache_protected_len
        if start < self.kllm_config.min_prefix_tokens:
            return Reason.SHORT, None
        aligned = up_to - up_to % self.page_size
        if aligned == 0:
            return Reason.SHORT, None
        if aligned < start:
            return Reason.STALE, None
        prompt_len = len(req.origin_input_ids)
        prompt_aligned = prompt_len - prompt_len % self.page_size
        ends = self._path_ends(anchor) if 0 < prompt_aligned < start else None
        plan = prompt_touch_depth(prompt_aligned, aligned, start, ends)
        if isinstance(plan, Reason):
            return plan, None
        return None, plan

    def _path_ends(self, anchor: Any) -> list[int]:
        depths = []
        node = anchor
        while node is not self.tree_core.root_node:
            depths.append(len(node.key))
            node = node.parent
        ends, total = [], 0
        for d in reversed(depths):
            total += d
            ends.append(total)
        return ends

    def _save_state(self, req: Any) -> None:
        lock = req.lock
        if req.finished() or lock is None or lock.node != req.last_node:
            setattr(req, _REQ_ATTR, None)
            return
        node = self.tree_core._node_arena.get(req.last_node) if not self._kllm_unsupported else None
        state = WalkState(node_id=req.last_node, depth=req.kv.cache_protected_len, epoch=self.kllm_epoch)
        setattr(req, _REQ_ATTR, (state, node))

    # ---- the checkpoint ----

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if self._kllm_rust:
            if req.__dict__.get(rust_core_path.RUST_REQ_ATTR) is None and (
                req.finished_reason is not None or up_to >= len(req.origin_input_ids)
            ):
                # Rust core, no saved state, and the prompt is complete (a one-chunk prompt, or
                # the finishing checkpoint): stock, and nothing to save. Counted, not timed: this
                # is every short request's path and must stay as cheap as stock.
                counters = self.kllm_counters
                counters.record_full(Reason.FINISH if req.finished_reason is not None else Reason.NO_STATE)
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
                if self.kllm_observer is not None:
                    self.kllm_observer(counters)
                return
            self._checkpoint_rust(req, up_to, kwargs, perf_counter())
            return
        t0 = perf_counter()
        counters = self.kllm_counters
        if self._kllm_unsupported:
            # The whole cache is stock (e.g. Rust TreeCore): keep the per-checkpoint cost at a count.
            counters.record_full(Reason.UNSUPPORTED_CACHE)
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            counters.full_seconds += perf_counter() - t0
            if self.kllm_observer is not None:
                self.kllm_observer(counters)
            return
        reason, prompt_touch = self._route(req, up_to, kwargs)
        if reason is None:
            start = req.kv.cache_protected_len
            self._checkpoint_tail(req, up_to, prompt_touch)
            counters.record_tail(req.kv.cache_protected_len - start, start)
            self._save_state(req)
            counters.tail_seconds += perf_counter() - t0
        else:
            counters.record_full(reason)
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            self._save_state(req)
            counters.full_seconds += perf_counter() - t0
        if self.kllm_observer is not None:
            self.kllm_observer(self.kllm_counters)

    def _checkpoint_rust(self, req: Any, up_to: int, kwargs: dict[str, Any], t0: float) -> None:
        """Rust TreeCore: the walk stays the binding's (whole key from the root); the key, value
        and new-index work is done for the tail only (`rust_core_path`)."""
        counters = self.kllm_counters
        if self._kllm_unsupported:
            reason: Reason | None = Reason.UNSUPPORTED_CACHE
        else:
            reason = rust_core_path.route(self, req, up_to, kwargs)
        if reason is None:
            start = req.kv.cache_protected_len
            rust_core_path.checkpoint_tail(self, req, up_to)
            counters.record_tail(req.kv.cache_protected_len - start, start)
            counters.tail_seconds += perf_counter() - t0
        else:
            counters.record_full(reason)
            super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            if reason is not Reason.FINISH:  # a finishing request's state dies in on_release
                rust_core_path.save_state(self, req, up_to)
            counters.full_seconds += perf_counter() - t0
        if self.kllm_observer is not None:
            self.kllm_observer(counters)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        # Finish, abort and retraction all release here; the state dies with the KV row.
        d = req.__dict__
        if d.get(_REQ_ATTR) is not None:
            d[_REQ_ATTR] = None
        if d.get(rust_core_path.RUST_REQ_ATTR) is not None:
            d[rust_core_path.RUST_REQ_ATTR] = None
        super().on_release(req, checkpointed=checkpointed)

    def _checkpoint_tail(self, req: Any, up_to: int, prompt_touch: int | None) -> None:
        """Stock `checkpoint_into_tree` for a FULL-only request, walking from the saved node
        instead of the root. `_route` has established every precondition."""
        tc: UnifiedTreeCore = self.tree_core
        _, anchor = getattr(req, _REQ_ATTR)
        is_finished = req.finished()
        start = req.kv.cache_protected_len
        aligned = up_to - up_to % self.page_size
        row = req.kv.req_pool_idx

        params = InsertParams(
            prev_prefix_len=start,
            inserted_len=req.kv.cache_inserted_len,
            priority=req.priority or 0,
            session_id=req.session_id,
            rotation_base=req.kv_rotation_base,
        )
        for comp in self._components_tuple:
            comp.prepare_for_caching_req(
                req=req, insert_params=params, token_ids_len=up_to, is_finished=is_finished
            )
        params.key = RadixKey(
            req.full_untruncated_fill_ids[start:aligned],
            req.extra_key,
            is_bigram=False,
            cache_salt=req.cache_salt,
        )
        params.value = self.req_to_token_pool.req_to_token[row, start:aligned].to(
            dtype=torch.int64, copy=True
        )
        priority = params.priority if params.priority is not None else 0

        path = self._path_nodes(anchor)
        result = self._insert_from(anchor, start, path, params, priority)
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, aligned)
        if prompt_touch is not None:
            # Stock re-inserts the prompt key to split at the prompt boundary; here that
            # boundary is already a node end, so the insert reduces to touching the path.
            depth, prompt_path = 0, []
            for node in path:
                if depth >= prompt_touch:
                    break
                prompt_path.append(node)
                depth += len(node.key)
            self._touch_path(prompt_path, min(priority + 1, torch.iinfo(torch.int64).max), None)

        new_last_node = result.last_device_node
        if aligned > start:
            tail_indices = tc.collect_full_device_indices(new_last_node, anchor.id)
            assert start + len(tail_indices) == aligned, (start, len(tail_indices), aligned)
            self.req_to_token_pool.write((row, slice(start, aligned)), tail_indices)

        self._move_lock(req, anchor, new_last_node)
        req.kv.cache_protected_len = aligned
        req.last_node = new_last_node
        for comp in self._components_tuple:
            comp.cleanup_after_caching_req(
                req, is_finished=is_finished, insert_result=result, insert_params=params
            )
        if self.kllm_config.verify:
            self._verify(req, aligned)

    def _move_lock(self, req: Any, anchor: Any, new_node_id: Any) -> None:
        """Stock `unlock(req.lock)` then `lock(new_last_node)`, for a new node below the locked
        anchor. Both stock walks run to the root; their net effect on the anchor and everything
        above it is nil (-1 then +1 on each lock count, sizes moved out and back), so only the
        nodes from the new node up to the anchor are locked here, with the FULL component's
        own accounting (`FullComponent.acquire_component_lock`)."""
        tc: UnifiedTreeCore = self.tree_core
        skipped = (ComponentType.MAMBA,) if envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.get() else ()
        new = tc.node_by_id(new_node_id)
        if new is anchor and req.lock.receipt.skipped_lock_components == skipped:
            return
        if new is anchor:
            self.unlock(req.lock)
            req.lock = self.lock(new_node_id, skip_lock_components=skipped)
            return
        comp = self._components_tuple[0]
        ct = comp.component_type
        cur = new
        while cur is not anchor:
            cd = cur.component_data[ct]
            assert cd.value is not None, f"tail node {cur.id} has no device value"
            if cd.lock_ref == 0:
                n = comp.reclaimable_value_len(cur)
                tc.component_evictable_size_[ct] -= n
                tc.component_protected_size_[ct] += n
            cd.lock_ref += 1
            tc.evictable_device_leaves.discard(cur)
            cur = cur.parent
        tc._update_evictable_leaf_sets(new)
        req.lock = TreeLock(new_node_id, DecLockRefParams(node_id=new_node_id, skipped_lock_components=skipped))

    def _path_nodes(self, anchor: Any) -> list[Any]:
        """The protected path below the root, root-to-anchor, through parent links."""
        path = []
        node = anchor
        root = self.tree_core.root_node
        while node is not root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _touch_path(self, path: list[Any], priority: int, inserted_len: int | None) -> list[Any]:
        """What the stock insert walk does to each node it passes without splitting: touch it
        (LRU time), raise its priority, count a hit where the node ends past `inserted_len`."""
        tc: UnifiedTreeCore = self.tree_core
        actions: list[Any] = []
        # `_touch_node` for a FULL-only tree (the only kind routed here) is this one stamp.
        clock = get_and_increase_time_counter
        tc.root_node.last_access_time = clock()
        tc.root_node.priority = max(tc.root_node.priority, priority)
        end = 0
        for node in path:
            node.last_access_time = clock()
            if node.priority < priority:
                node.priority = priority
            end += len(node.key)
            if inserted_len is not None and end > inserted_len and tc._inc_hit_count_and_check(node):
                actions.append(tc._build_backup_kv_action(node))
        return actions

    def _insert_from(
        self, anchor: Any, depth: int, path: list[Any], params: InsertParams, priority: int
    ) -> InsertResult:
        """`UnifiedRadixCache.insert` + `UnifiedTreeCore.begin_insert`, started at `anchor`,
        which sits `depth` tokens below the root on `path`; the path itself gets the stock
        walk's per-node treatment (`_touch_path`) in the same root-to-leaf order."""
        tc: UnifiedTreeCore = self.tree_core
        assert not tc.has_ongoing_insert(), "re-entrant insert"
        if self.buffer_pipeline is not None:
            self.buffer_pipeline.begin_insert_walk()
        self.insert_session_id = params.session_id
        try:
            self._apply_cache_actions(self._touch_path(path, priority, params.inserted_len))
            key = params.key.page_aligned(self.page_size)
            tc._ongoing_insert_walk_state = _InsertWalkState(
                phase=_InsertPhase.WALK,
                node=anchor,
                key=key,
                value=params.value[: len(key)],
                params=params,
                priority=priority,
                result=InsertResult(prefix_len=0, adopted_ranges=None),
                total_prefix_length=depth,
            )
            step = tc._advance_insert()
            while True:
                self._apply_cache_actions(step.actions)
                if step.result is not None:
                    assert not step.result.cache_actions
                    return step.result
                step = tc.resume_insert()
        finally:
            try:
                self._apply_cache_actions(tc.end_insert())
            finally:
                self.insert_session_id = None
            if self.buffer_pipeline is not None:
                self.buffer_pipeline.end_insert_walk()

    def _verify(self, req: Any, aligned: int) -> None:
        key = RadixKey(req.full_untruncated_fill_ids[:aligned], req.extra_key, cache_salt=req.cache_salt)
        match = self.tree_core.match_prefix(MatchPrefixParams(key=key))
        if match.device_prefix_len != aligned or match.last_device_node != req.last_node:
            raise AssertionError(
                f"incr_prefix verify: tail insert left {req.last_node}@{aligned}, "
                f"root walk finds {match.last_device_node}@{match.device_prefix_len}"
            )


def _factory(ctx: Any) -> Any:
    from kllm_plugins import runtime
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    cls = IncrementalUnifiedRadixCache
    try:
        cfg = runtime.config_of("incr_prefix")
    except Exception:  # noqa: BLE001 - selected by flag without the plugin's config: defaults
        cfg = None
    if cfg is not None:
        cls = type("IncrementalUnifiedRadixCache", (IncrementalUnifiedRadixCache,), {"kllm_config": cfg})
        if cfg.force_python_treecore:
            ctx.params.tree_core_backend = "python"
    cache = create_unified_radix_cache(ctx, cache_class=cls)
    if isinstance(cache, IncrementalUnifiedRadixCache):
        from kllm_plugins.plugins.incr_prefix.stats_export import CounterExporter

        cache.kllm_observer = CounterExporter(cfg or IncrPrefixConfig())
    return cache


def register_backend() -> Any:
    """Registry patch: put `kllm_incremental` into SGLang's radix-cache registry (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, _factory)
    return lambda: get_radix_cache_factory(BACKEND_NAME) is _factory


def build_cpu_cache(
    *,
    page_size: int,
    kv_size: int,
    max_context_len: int,
    max_num_reqs: int = 8,
    tree_core: str = "python",
    incremental: bool = False,
    config: IncrPrefixConfig | None = None,
) -> tuple[Any, Any, Any]:
    """A real UnifiedRadixCache (FULL component) on CPU, built the way SGLang's test kit builds
    one (`sglang/test/kits/unified_radix_cache/fixtures.py:build_fixture`), stock or incremental.
    Returns `(cache, allocator, req_to_token_pool)`. For the plugin's tests and benchmarks."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    pool = ReqToTokenPool(
        size=max_num_reqs, max_context_len=max_context_len, device="cpu", enable_memory_saver=False
    )
    kv_pool = MHATokenToKVPool(
        size=kv_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=4,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    params = CacheInitParams(
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        disable=False,
        tree_components=(ComponentType.FULL,),
        eviction_policy="lru",
        tree_core_backend=tree_core,
    )
    if incremental:
        cls: type = IncrementalUnifiedRadixCache
        if config is not None:
            cls = type("IncrementalUnifiedRadixCache", (IncrementalUnifiedRadixCache,), {"kllm_config": config})
    else:
        cls = UnifiedRadixCache
    cache = cls(params=params)
    return cache, allocator, pool

