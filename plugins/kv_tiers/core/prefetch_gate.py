"""Layer: plugin core (no SGLang import). Bounded L3 prefetch for queued requests.

HiCache starts an L3 prefetch for each request entering the waiting queue. On a busy instance
those transfers compete with the running batch for memory bandwidth, host buffers and CPU
time. The gate admits a prefetch only when it is worth it (the hit is at least the measured
break-even length) and when the prefetches already in flight stay within a token and an
operation budget; anything else is left to recompute.

Host memory (L2) is the other bound. A finished prefetch's span stays in L2 until its request is
admitted (the admission hold keeps it there), so the tokens of spans waiting for admission plus
those still being read must fit the room L2 can give queued requests (`l2_budget`): beyond it a
new prefetch would only evict an earlier one, or fail for want of host memory. A prefetch refused
for a budget (`deferred`) is worth starting later, when room frees, rather than recomputed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


BUDGET_REASONS = frozenset({"ops_budget", "token_budget", "l2_budget"})


@dataclass(frozen=True)
class GateDecision:
    admit: bool
    reason: str

    @property
    def deferred(self) -> bool:
        """Refused only for want of room now: worth asking again once prefetches finish or spans
        are admitted."""
        return not self.admit and self.reason in BUDGET_REASONS


class PrefetchGate:
    def __init__(self, max_inflight_ops: int = 4, max_inflight_tokens: int = 8192) -> None:
        if max_inflight_ops < 1 or max_inflight_tokens < 1:
            raise ValueError(
                f"max_inflight_ops and max_inflight_tokens must be >= 1, got {max_inflight_ops}, {max_inflight_tokens}"
            )
        self.max_inflight_ops = max_inflight_ops
        self.max_inflight_tokens = max_inflight_tokens

    def decide(self, candidate_tokens: int, min_fetch_tokens: float, inflight_ops: int,
               inflight_tokens: int, explore: Callable[[], bool] | None = None, held_tokens: int = 0,
               l2_budget: float = math.inf) -> GateDecision:
        """`explore` is asked only for a prefetch refused as not worth it (e.g.
        `FetchOrRecompute.explore_refused`); True admits it anyway, to re-measure the store.
        `held_tokens`: finished spans waiting in L2 for their requests; with the tokens in flight
        they must stay within `l2_budget`."""
        if candidate_tokens <= 0:
            return GateDecision(False, "empty")
        if math.isinf(min_fetch_tokens) or candidate_tokens < min_fetch_tokens:
            if explore is not None and explore():
                return GateDecision(True, "explore")
            return GateDecision(False, "recompute_cheaper")
        if inflight_ops >= self.max_inflight_ops:
            return GateDecision(False, "ops_budget")
        if inflight_tokens + candidate_tokens > self.max_inflight_tokens and inflight_ops > 0:
            # An idle gate admits one oversized prefetch rather than never prefetching it.
            return GateDecision(False, "token_budget")
        if inflight_tokens + held_tokens + candidate_tokens > l2_budget and (inflight_ops > 0 or held_tokens > 0):
            return GateDecision(False, "l2_budget")
        return GateDecision(True, "admitted")
