"""Layer: plugin core (no SGLang import). Pass planning with several partial prefills at once.

SGLang 0.5.23 keeps one partially prefilled request (`Scheduler.chunked_req`); `FairPolicy`
works inside that. This planner is for an engine that can hold several (vLLM's
`max_num_partial_prefills` / `max_long_partial_prefills`), used by the benchmark's engine
simulation to show what the second slot is worth, and the contract an SGLang change would
implement (docs/fair_sched.md, "Several partial prefills").

Each pass has a token budget `budget_tokens + extra_tokens`. Requests with prefill work left
(started or waiting) are taken in the order of `order_key` (prefill tokens processed at
arrival + age_weight x work, smallest first). Each gets min(remaining, budget_tokens, what is
left of the pass); a request that does not finish in this pass is partial, and a new partial is
allowed only while fewer than `max_partial` requests are partial and, if its remaining work is
over `long_tokens`, fewer than `max_long_partial` partial requests are long. Started partial
requests keep their KV between passes, whether or not they run in one.

Progress (the starvation bound, `tests/unit/test_fair_sched_core.py`): in every pass the first
request in key order that is allowed to run gets min(remaining, budget_tokens) tokens, since the
pass starts with at least `budget_tokens` left. A request that is not allowed (the partial caps
are full) waits only for the partial requests, which all keep running.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PartialParams:
    budget_tokens: int
    """Largest chunk of one request in one pass (SGLang's chunked-prefill size)."""
    extra_tokens: int = 0
    """Pass tokens beyond budget_tokens (the pass budget is their sum)."""
    max_partial: int = 4
    """Requests partially prefilled at once (SGLang: 1)."""
    max_long_partial: int = 1
    """Of those, how many may have more than `long_tokens` left."""
    long_tokens: int = 0
    """Remaining work above which a partial request counts as long (0: four budgets)."""
    age_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be >= 1, got {self.budget_tokens}")
        if self.extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {self.extra_tokens}")
        if self.max_partial < 1:
            raise ValueError(f"max_partial must be >= 1, got {self.max_partial}")
        if not 1 <= self.max_long_partial <= self.max_partial:
            raise ValueError(f"max_long_partial must be in [1, max_partial={self.max_partial}], got {self.max_long_partial}")
        if self.long_tokens < 0:
            raise ValueError(f"long_tokens must be >= 0, got {self.long_tokens}")
        if not self.age_weight >= 0.0:
            raise ValueError(f"age_weight must be >= 0, got {self.age_weight}")

    @property
    def long_limit(self) -> int:
        return self.long_tokens or 4 * self.budget_tokens


@dataclass(frozen=True)
class Candidate:
    rid: str
    remaining: int
    """Prefill tokens left."""
    clock: int
    """Prefill tokens processed when it arrived."""
    seq: float
    """Arrival order (ties)."""
    work: int = 0
    """Uncached prompt at arrival (for the key; 0: `remaining`)."""
    started: bool = False
    """It is partially prefilled (holds KV from earlier passes)."""


def candidate_key(c: Candidate, age_weight: float) -> tuple[float, float]:
    return (c.clock + age_weight * (c.work or c.remaining), c.seq)


def plan_pass(cands: Sequence[Candidate], p: PartialParams) -> list[tuple[str, int]]:
    """This pass's prefill: (rid, tokens) in key order. Started requests that are not in the
    list keep their progress; requests missing from it wait."""
    left = p.budget_tokens + p.extra_tokens
    partial = sum(1 for c in cands if c.started)
    long_partial = sum(1 for c in cands if c.started and c.remaining > p.long_limit)
    out: list[tuple[str, int]] = []
    for c in sorted(cands, key=lambda c: candidate_key(c, p.age_weight)):
        if left <= 0:
            break
        take = min(c.remaining, p.budget_tokens, left)
        if take < c.remaining and not c.started:
            is_long = c.remaining > p.long_limit
            if partial >= p.max_partial or (is_long and long_partial >= p.max_long_partial):
                continue  # no slot for another partial request: later (smaller) ones may still fit
            partial += 1
            long_partial += is_long
        elif take == c.remaining and c.started:
            partial -= 1  # finishes this pass: its slot frees for later candidates
            long_partial -= c.remaining > p.long_limit
        out.append((c.rid, take))
        left -= take
    return out
