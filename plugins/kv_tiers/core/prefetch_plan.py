"""Layer: plugin core (no SGLang import). What to do with one L3 prefetch HiCache is about to start.

HiCache asks its storage to prefetch a queued request's hit (`prefetch_from_storage`); the
adapter turns the call into a `PrefetchAsk` (lengths, what is in flight, what is held) and
applies the `PrefetchPlan` returned here:

- with adaptive thresholds, HiCache's `prefetch_threshold` is set first to the break-even length
  of this request's length (fetch or recompute, `FetchOrRecompute.min_fetch_tokens`; "never" as a
  length no context reaches);
- a prefetch not in flight yet goes to the gate (`PrefetchGate`): worth it, and room in flight and
  in L2; one admitted below the break-even length to re-measure the store lowers the threshold to
  a page, so that HiCache starts it;
- a refused prefetch starts nothing; one refused for room only is deferred (re-issued in queue
  order when room frees) unless the L3 probe says it would miss;
- an admitted one is probed first (its first page, and the last page the threshold needs) when
  the backend has a probe: a certain or short miss starts nothing.

Without adaptive thresholds and without a probe the plugin stays out of the way (`engaged`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kllm_plugins.plugins.kv_tiers.core.prefetch_gate import GateDecision
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState

NO_FETCH_THRESHOLD = 1 << 30  # "never": longer than any context


@dataclass(frozen=True)
class PrefetchAsk:
    """One `prefetch_from_storage` call, as the adapter reads it."""

    candidate_tokens: int  # new tokens the prefetch would look up
    context_tokens: int  # the request's length, as far as told (prefix keys x page + candidates)
    page_size: int
    in_flight: bool  # this request's prefetch runs already
    hicache_threshold: int  # HiCache's prefetch_threshold before this call
    inflight_ops: int = 0
    inflight_tokens: int = 0
    held_tokens: int = 0  # spans waiting in L2 for their requests (admission holds)
    l2_budget: float = math.inf  # what L2 can give queued requests; inf with holds off
    holds_on: bool = False
    reissued_hit: bool = False  # HiCache re-issues a prefetch for a known hit (not probed again)


@dataclass(frozen=True)
class PrefetchPlan:
    threshold: int | None  # set HiCache's prefetch_threshold to this first (None: leave it)
    gate: GateDecision | None  # None: not asked (in flight already, or HiCache's own threshold declines)
    probe: bool  # probe L3 before starting (or deferring) the prefetch
    defer: bool = False  # refused for room only: re-issue later (unless the probe says miss)

    @property
    def start(self) -> bool:
        """Let HiCache go on (it may still decline by its own threshold)."""
        return self.gate is None or self.gate.admit

    @property
    def track(self) -> bool:
        """A new prefetch this plan starts: its wait is measured."""
        return self.gate is not None and self.gate.admit


def adaptive(state: TierState) -> bool:
    return state.fetch is not None and state.cfg.adaptive_thresholds


def engaged(state: TierState) -> bool:
    """Whether the plugin has anything to decide (else HiCache's call goes through untouched)."""
    return adaptive(state) or state.probe is not None


def plan_prefetch(state: TierState, ask: PrefetchAsk) -> PrefetchPlan:
    """The plan for `ask` (see the module docstring). Logs a tier's turn to or from "not worth
    fetching" and counts refused decisions towards the fetch policy's exploration."""
    threshold = None
    min_tokens = 0.0
    hicache_threshold = ask.hicache_threshold
    if adaptive(state):
        assert state.fetch is not None
        min_tokens = state.fetch.min_fetch_tokens("l3", ask.context_tokens, busy=state.busy())
        state.note_threshold("l3", min_tokens, ask.context_tokens)
        threshold = max(ask.page_size, NO_FETCH_THRESHOLD if min_tokens == math.inf else int(min_tokens))
        hicache_threshold = threshold
    elif ask.in_flight or ask.candidate_tokens < hicache_threshold:
        # HiCache's own threshold declines it (or it runs already): nothing to probe or track
        return PrefetchPlan(None, None, False)
    if ask.in_flight:
        return PrefetchPlan(threshold, None, False)
    # the in-flight and L2 bounds apply with or without adaptive thresholds; without them
    # HiCache's own threshold (checked above) is the worth-it rule
    fetch = state.fetch
    explore = (lambda: fetch.explore_refused("l3")) if adaptive(state) and fetch is not None else None
    d = state.gate.decide(ask.candidate_tokens, min_tokens, ask.inflight_ops, ask.inflight_tokens, explore=explore,
                          held_tokens=ask.held_tokens, l2_budget=ask.l2_budget)
    if d.reason == "explore":  # admitted below the break-even length: let HiCache start it
        threshold = ask.page_size
    probe = state.probe is not None and not ask.reissued_hit
    # a refusal for room is re-issued later only with the holds on (they bound L2's room)
    return PrefetchPlan(threshold, d, probe, defer=d.deferred and ask.holds_on)


def probe_pages(keys: int, threshold: int, page_size: int) -> int:
    """How many leading pages a prefetch needs in L3 to pass HiCache's `threshold` (at least one,
    at most `keys`): the probe checks the first page and that one."""
    page = max(1, page_size)
    return min(keys, max(1, -(-max(threshold, page) // page)))


def load_back_threshold(state: TierState) -> int | None:
    """HiCache's L2 load-back threshold from the L2 break-even length (None: leave it): "never"
    while L2 is slower than recomputing, except every `explore_every`-th refused load-back."""
    if state.fetch is None or not state.cfg.adaptive_thresholds:
        return None
    m = state.fetch.min_fetch_tokens("l2")
    state.note_threshold("l2", m)
    if m == math.inf and state.fetch.explore_refused("l2"):
        state.count("l2_explored")
        return 0  # loads anyway: L2 is re-measured
    return NO_FETCH_THRESHOLD if m == math.inf else int(m)
