"""Layer: plugin core (no SGLang import). L3-loaded L2 spans kept alive until their request runs.

HiCache reads a queued request's L3 hit into host memory (L2) and inserts it into the radix tree
unlocked when the scheduler first looks at the request. Under load that request can then wait
several passes for device room while other work needs host memory (write-through backups, the
prefetches of requests behind it): the least recently used host leaves go first, and the span
loaded for the request nearest to running is among them. SGLang then counts the tokens as
`cache_admission_shortfall` and the request recomputes the prefix it paid to read.

`AdmissionHolds` is the bookkeeping of one lock per such span, taken when the span lands and
released when its request is admitted or aborted, within a token budget (a share of the host
pool, so backups keep room) and an age limit (a request that is never admitted cannot pin host
memory forever). The lock itself is opaque here: the adapter takes and releases it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

L = TypeVar("L")  # the adapter's lock handle


@dataclass
class _Hold(Generic[L]):
    lock: L
    tokens: int
    since: float


class AdmissionHolds(Generic[L]):
    """Holds keyed by request, in the order they were taken (the oldest expire first)."""

    def __init__(self, max_tokens: int, max_age_s: float) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_tokens = max_tokens
        self.max_age_s = max_age_s
        self._holds: OrderedDict[Hashable, _Hold[L]] = OrderedDict()
        self.tokens = 0
        # held / held_tokens, over_budget / over_budget_tokens, and one count per release outcome
        self.counts: dict[str, int] = {"held": 0, "held_tokens": 0, "over_budget": 0, "over_budget_tokens": 0,
                                       "admitted": 0, "aborted": 0, "expired": 0, "reheld": 0, "reset": 0}

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, request: Hashable) -> bool:
        return request in self._holds

    def room_for(self, tokens: int) -> bool:
        """Whether a span of `tokens` fits the budget (a request already held is not asked)."""
        return 0 < tokens and self.tokens + tokens <= self.max_tokens

    def refuse(self, tokens: int) -> None:
        """Count a span that did not fit the budget (it stays unheld, as stock leaves it)."""
        self._count("over_budget")
        self._count("over_budget_tokens", tokens)

    def hold(self, request: Hashable, lock: L, tokens: int, now: float) -> None:
        """Record `lock` over `tokens` for `request`; the caller checked `room_for` first."""
        if request in self._holds:
            raise ValueError(f"request {request!r} is already held")
        if not self.room_for(tokens):
            raise ValueError(f"a hold of {tokens} tokens exceeds the budget ({self.tokens}/{self.max_tokens} used)")
        self._holds[request] = _Hold(lock, tokens, now)
        self.tokens += tokens
        self._count("held")
        self._count("held_tokens", tokens)

    def release(self, request: Hashable, outcome: str) -> L | None:
        """Drop `request`'s hold (outcome "admitted", "aborted", or "reheld": a fresh span replaces
        it); its lock for the caller to release, or None if it held none."""
        h = self._holds.pop(request, None)
        if h is None:
            return None
        self.tokens -= h.tokens
        self._count(outcome)
        return h.lock

    def expired(self, now: float) -> list[L]:
        """Drop the holds older than `max_age_s`; their locks for the caller to release."""
        out: list[L] = []
        while self._holds:
            request, h = next(iter(self._holds.items()))
            if now - h.since < self.max_age_s:
                break
            del self._holds[request]
            self.tokens -= h.tokens
            self._count("expired")
            out.append(h.lock)
        return out

    def clear(self, outcome: str = "reset") -> list[L]:
        """Drop every hold (the tree they lock was rebuilt); their locks, in the order taken."""
        out = [h.lock for h in self._holds.values()]
        self._count(outcome, len(out))
        self._holds.clear()
        self.tokens = 0
        return out

    def note(self, what: str) -> None:
        """Count an event of the adapter's (a span it could not hold, and why)."""
        self._count(what)

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def snapshot(self) -> dict[str, int]:
        return {"held_now": len(self._holds), "held_tokens_now": self.tokens, "budget_tokens": self.max_tokens,
                **self.counts}
