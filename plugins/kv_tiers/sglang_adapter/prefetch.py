"""Layer: SGLang adapter of the kv_tiers plugin. L3 prefetch: the gate, the probe and just-in-time re-issue.

`around_prefetch_from_storage` reads HiCache's prefetch call into a core `PrefetchAsk` (the
request's lengths, HiCache's prefetches in flight, the admission holds) and applies the core
`PrefetchPlan` (`core/prefetch_plan.py`): HiCache's threshold, refusal, deferral, the L3 probe.
`after_process_hicache_events` re-issues deferred prefetches in waiting-queue order.
"""
from __future__ import annotations

import time
from array import array
from typing import Any, Callable

from kllm_plugins.plugins.kv_tiers.core.prefetch_plan import PrefetchAsk, engaged, plan_prefetch, probe_pages
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState, trim_oldest
from kllm_plugins.plugins.kv_tiers.sglang_adapter import state
from kllm_plugins.plugins.kv_tiers.sglang_adapter.admission import holds_of


def _prefetch_operation(value: Any) -> Any:
    """The PrefetchOperation of an `ongoing_prefetch` entry: SGLang 0.5.23 keeps a NamedTuple whose
    `operation` is its fourth field, not its last (reading the last one, a dict of component
    transfers, counted every prefetch as 0 tokens in flight)."""
    return getattr(value, "operation", value)


def _inflight(cache: Any) -> tuple[int, int]:
    """Prefetches in flight and the host tokens they will take.

    An operation's `hash_value` holds the pages it will load only once the storage thread's hit
    query has run (`all_hash_values` is set then); before that it is empty. Counting such a
    prefetch as 0 let the gate start more prefetches than the admission hold's L2 budget keeps
    (on a loaded machine the span past the budget was refused a hold and evicted before its
    request ran). Until its query has run, an operation counts its whole page-aligned candidate
    span, an upper bound of what it can load."""
    ongoing = getattr(cache, "ongoing_prefetch", None) or {}
    page = int(getattr(cache, "page_size", 1) or 1)
    tokens = 0
    for value in list(ongoing.values()):
        op = _prefetch_operation(value)
        if getattr(op, "all_hash_values", None) is None and not getattr(op, "hash_value", None):
            tokens += len(getattr(op, "token_ids", None) or ()) // page * page
        else:
            tokens += len(getattr(op, "hash_value", None) or []) * page
    return len(ongoing), tokens


def _full_prefix_keys(cache: Any, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Pass the storage keys of the whole matched prefix as `prefix_keys`.

    SGLang 0.5.23 passes the keys of the anchor node's ancestors only (`get_prefix_hash_values`
    starts at the node's parent), so a lookup anchored on a node right under the root (a system
    prompt, a conversation's first turn) reaches the backend with no prefix keys at all, and the
    backend cannot tell a conversation's next turn from a one-off prompt. The anchor's own keys
    complete the chain (a write's prefix keys are its node's ancestors, which is complete there).
    """
    given = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
    if given is None:
        return args, kwargs  # hicache_storage_pass_prefix_keys is off
    try:
        own = list(cache.tree_core.get_hash_values(node) or [])
    except Exception:  # another tree core: leave SGLang's keys as they are
        return args, kwargs
    if not own or list(given[-len(own):]) == own:
        return args, kwargs
    full = list(given) + own
    if len(args) >= 2:
        return (args[0], full, *args[2:]), kwargs
    return args, {**kwargs, "prefix_keys": full}


def _page_keys(cache: Any, new_input_tokens: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               pages: int | None = None) -> list[str] | None:
    """The L3 storage keys a prefetch would look up (the first `pages`, or all), computed as
    HiCache's storage query does (`get_storage_hash_str` over the page-aligned tokens, chained on
    the anchor's hash, seeded by the request's namespace); None where it cannot be told (bigram
    keys, input shorter than a page)."""
    try:
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        page = int(getattr(cache, "page_size", 1))
        n = len(new_input_tokens) // page if pages is None else min(pages, len(new_input_tokens) // page)
        if n <= 0 or getattr(getattr(cache, "tree_core", None), "is_eagle", False):
            return None
        last_hash = args[0] if args else kwargs.get("last_hash")
        key = RadixKey(new_input_tokens[: n * page], extra_key=kwargs.get("extra_key"),
                       cache_salt=kwargs.get("cache_salt"))
        hashes = get_storage_hash_str(key, last_hash, page_size=page)
        return list(hashes) if isinstance(hashes, list) else [hashes]
    except Exception:  # another SGLang's key scheme: no probe, HiCache's lookup decides
        return None


def _ongoing(cache: Any) -> dict[Any, Any]:
    return getattr(cache, "ongoing_prefetch", None) or {}


def around_prefetch_from_storage(original: Callable[..., Any], self: Any, request: Any, last_host_node_id: Any,
                                 new_input_tokens: list[int], *args: Any, **kwargs: Any) -> Any:
    """Before HiCache starts an L3 prefetch for a queued request: with adaptive thresholds, set the
    prefetch threshold from the break-even length and apply the in-flight budget; with or without
    them, probe the first page and start no prefetch for a certain miss. A prefetch that starts
    leaves its token key for the admission hold."""
    t = state.tiers()
    started = request in _ongoing(self)
    result = _prefetch(t, original, self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    if t.cfg.admission_hold and not started and request in _ongoing(self):
        trim_oldest(t.prefetch_spans)
        # the tree keys are int64 arrays (SGLang's Rust tree core accepts nothing else)
        tokens = array("q", kwargs.get("matched_prefix_tokens") or ())
        tokens.extend(new_input_tokens)
        t.prefetch_spans[request] = (tokens, kwargs.get("extra_key"), kwargs.get("cache_salt"))
    return result


def _prefetch(t: TierState, original: Callable[..., Any], self: Any, request: Any, last_host_node_id: Any,
              new_input_tokens: list[int], *args: Any, **kwargs: Any) -> Any:
    if not engaged(t):
        return original(self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    args, kwargs = _full_prefix_keys(self, last_host_node_id, args, kwargs)
    page = int(getattr(self, "page_size", 1))
    prefix = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
    in_flight = request in _ongoing(self)
    ops, tokens, holds = 0, 0, None
    if not in_flight:
        ops, tokens = _inflight(self)
        holds = holds_of(t, self)
    plan = plan_prefetch(t, PrefetchAsk(
        candidate_tokens=len(new_input_tokens),
        context_tokens=len(prefix or ()) * page + len(new_input_tokens),  # the request's length, as far as told
        page_size=page, in_flight=in_flight,
        hicache_threshold=int(getattr(self, "prefetch_threshold", 0) or 0),
        inflight_ops=ops, inflight_tokens=tokens,
        held_tokens=holds.tokens if holds is not None else 0,
        l2_budget=holds.max_tokens if holds is not None else float("inf"),
        holds_on=holds is not None, reissued_hit=kwargs.get("storage_hit_end") is not None))
    if plan.threshold is not None:
        self.prefetch_threshold = plan.threshold
    if plan.gate is not None:
        if plan.gate.reason == "explore":
            t.count("prefetch_explored")
        t.meter.prefetch(plan.gate.reason)
        if not plan.start:
            t.count("prefetch_refused")
            # a prefetch refused for room is started later, in queue order, unless it would miss
            if plan.defer and not (plan.probe and _probe_misses(t, self, new_input_tokens, args, kwargs)):
                t.defer(request)
            return None
        if plan.probe and _probe_misses(t, self, new_input_tokens, args, kwargs):
            return None
        t.count("prefetch_admitted")
    result = original(self, request, last_host_node_id, new_input_tokens, *args, **kwargs)
    if plan.track and request in _ongoing(self):
        t.prefetch_begun(request)
    return result


def _probe_misses(t: TierState, cache: Any, new_input_tokens: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> bool:
    """Probe the pages a prefetch needs; True = L3 cannot serve it (start no prefetch).

    Under HiCache's default "timeout" stop policy a request whose prefetch finds nothing still
    waits for it, about the timeout (1 s + 0.25 s per 1K tokens; 1.15-1.56 s measured), so a
    certain miss is not worth starting: the prefix is recomputed at once. A hit shorter than
    HiCache's `prefetch_threshold` (the break-even length under adaptive thresholds) is declined by
    HiCache only after its storage lookup, which the request waits for (2-3 ms per request at
    32-64 tokens, `benchmarks/kv_tiers/breakeven.py`): so the first page is probed and, when it
    is there, the last page the threshold needs."""
    assert t.probe is not None
    keys = _page_keys(cache, new_input_tokens, args, kwargs)
    if not keys:
        return False
    page = int(getattr(cache, "page_size", 1) or 1)
    need = probe_pages(len(keys), int(getattr(cache, "prefetch_threshold", page) or page), page)
    t0 = time.perf_counter()
    try:
        first = t.probe(keys[0])
        enough = first and (need == 1 or t.probe(keys[need - 1]))
    finally:
        t.spent("probe", time.perf_counter() - t0)
    if enough:
        return False
    outcome = "short" if first else "miss"
    t.count(f"prefetch_probe_{outcome}")
    t.meter.prefetch(f"l3_probe_{outcome}")
    # the lookup HiCache would have made still tells selective persistence about reuse (a
    # continuation, or the short hit: at least its first page): without it a store left empty
    # while dormant would stay so
    prefix = args[1] if len(args) >= 2 else kwargs.get("prefix_keys")
    t.note_lookup(keys, int(first), bool(prefix))
    return True


def after_process_hicache_events(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Each scheduler pass, after HiCache's own events and re-issues: start the deferred prefetches
    in waiting-queue order (the request nearest to running first) while the gate has room; the
    first one deferred again ends the walk. Room frees only when a prefetch ends or a hold is
    released, so a pass that finds the in-flight and held tokens as the last refusal left them
    walks nothing (a re-issue costs a prefix match and the probe's key hashing). Also notes the
    waiting queue's length: whether the next prefetch decisions and waits are a busy server's."""
    t = state.current()
    if t is None:
        return None
    queue = getattr(self, "waiting_queue", None) or ()
    t.waiting = len(queue)  # busy or idle, for the next decisions
    if not t.deferred:
        return None
    cache = self.tree_cache
    if _room_state(t, cache) == t.deferred_room:
        return None
    for req in list(queue):
        handle = getattr(req, "cache_request_handle", None)
        if handle not in t.deferred:
            continue
        del t.deferred[handle]
        t.count("prefetch_reissued")
        self._prefetch_kvcache(req)
        if handle in t.deferred:
            t.deferred_room = _room_state(t, cache)
            break
    return None


def _room_state(t: TierState, cache: Any) -> tuple[int, int, int]:
    ops, tokens = _inflight(cache)
    return ops, tokens, t.holds.tokens if t.holds is not None else 0
