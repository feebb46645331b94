"""Layer: SGLang adapter of the kv_tiers plugin. The admission hold on HiCache's host tree.

HiCache inserts the span a finished L3 prefetch read into the host tree unlocked; the hooks here
host-lock it (`inc_host_lock_ref` on its last host node, which keeps the path above it) until
its request is admitted or aborted, within the budget and age of the core `AdmissionHolds`.
"""
from __future__ import annotations

import logging
from array import array
from typing import Any

from kllm_plugins.plugins.kv_tiers.core.admission_hold import AdmissionHolds
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState
from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

logger = logging.getLogger("kllm.kv_tiers")


def holds_of(t: TierState, cache: Any) -> AdmissionHolds[tuple[Any, Any]] | None:
    """The admission holds, sized from the cache's host pool at first use; None with holds off or no pool."""
    if t.holds is None and t.cfg.admission_hold:
        pool = getattr(getattr(cache, "cache_controller", None), "mem_pool_host", None)
        t.ensure_holds(int(getattr(pool, "size", 0) or 0))
    return t.holds


def loaded_tokens(cache: Any, request: Any) -> int:
    """Tokens the request's L3 prefetch loaded into L2 (HiCache's own count)."""
    return int((getattr(cache, "prefetch_loaded_tokens_by_reqid", None) or {}).get(request, 0) or 0)


def after_handle_prefetch_result(result: Any, self: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    """HiCache has just put a finished prefetch's span into the host tree (from the storage ack
    drain of each scheduler pass, or when the scheduler reaches the request), unlocked: hold it."""
    t = state.current()
    if t is None or not t.prefetch_spans:
        return None
    request = getattr(operation, "handle", None)
    span = t.prefetch_spans.pop(request, None)
    if span is not None:
        _hold_loaded_span(t, self, request, span)
    return None


def _hold_loaded_span(t: TierState, cache: Any, request: Any, span: tuple[array[int], Any, Any]) -> None:
    """Lock the span's last host node (which keeps the path above it) until the request is admitted
    or aborted, if the budget has room. Holds past their age are released here first."""
    loaded = loaded_tokens(cache, request)
    holds = holds_of(t, cache)
    if holds is None:
        return
    now = t.clock()
    for lock in holds.expired(now):
        _unlock(t, cache, lock)
        t.hold_event("expired", counted=True)
    if loaded <= 0:
        t.hold_event("nothing_loaded")
        return
    if request in holds:
        # HiCache re-issued this request's lookup (its match shrank while it queued): the span just
        # inserted is the live one, so the hold moves to it
        old = holds.release(request, "reheld")
        if old is not None:
            _unlock(t, cache, old)
            t.hold_event("reheld", counted=True)
    if not holds.room_for(loaded):
        holds.refuse(loaded)
        t.hold_event("over_budget", counted=True)
        return
    try:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tokens, extra_key, cache_salt = span
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra_key=extra_key, cache_salt=cache_salt)))
        node = match.last_host_node
        if node is None or cache.is_root(node):
            t.hold_event("no_node")
            return
        params = cache.inc_host_lock_ref(node).to_dec_params()
    except Exception:  # another tree core or SGLang: leave the span as stock does
        logger.warning("kv_tiers: could not hold an L3-loaded span until admission", exc_info=True)
        t.hold_event("failed")
        return
    holds.hold(request, (node, params), loaded, now)
    t.hold_event("held", counted=True)


def _unlock(t: TierState, cache: Any, lock: tuple[Any, Any]) -> bool:
    """Release a hold's host lock. A lock whose node the tree no longer has (seen with the Rust
    TreeCore after a re-issued lookup) must not end the scheduler: counted (`release_failed`, in
    the snapshot and the metric) and logged the first time instead."""
    try:
        cache.dec_host_lock_ref(*lock)
        return True
    except Exception as e:  # noqa: BLE001 - any failure here would kill the scheduler's loop
        t.hold_event("release_failed")
        if t.holds is not None and t.holds.counts.get("release_failed") == 1:
            logger.warning("kv_tiers: an admission hold's host lock could not be released (%s: %s); "
                           "its node is gone from the tree (counted as release_failed from now on)",
                           type(e).__name__, e)
        return False


def after_reset(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """The radix tree was rebuilt (flush): its nodes and their locks are gone, so are the holds."""
    t = state.current()
    if t is not None and t.holds is not None:
        for _ in t.holds.clear("reset"):
            t.hold_event("reset", counted=True)
    return None


def _release_hold(cache: Any, request: Any, outcome: str) -> bool:
    t = state.current()
    if t is None:
        return False
    t.prefetch_spans.pop(request, None)
    t.deferred.pop(request, None)
    if t.holds is None:
        return False
    lock = t.holds.release(request, outcome)
    if lock is None:
        return False
    t.hold_event(outcome, counted=True)
    return _unlock(t, cache, lock)


def after_finish_storage_prefetch_admission(result: Any, self: Any, request: Any, fulfilled_tokens: int = 0,
                                            reason: Any = None, *args: Any, **kwargs: Any) -> Any:
    """The request is admitted (its L2 span loaded to the device, or recomputed): release its hold.
    A held span that still fell short is counted (it should not: the hold is what prevents it).
    Every admission is counted (`requests_admitted`, with or without a hold): a reader of the
    published snapshot can tell it is as recent as the admissions it waits for."""
    t = state.current()
    if t is not None:
        t.count("requests_admitted")
    if _release_hold(self, request, "admitted") and reason == "cache_admission_shortfall":
        assert t is not None
        t.hold_event("held_but_short")
    return None


def after_release_aborted_request(result: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """An aborted request's hold is released (and its pending span forgotten)."""
    _release_hold(self, request, "aborted")
    return None
