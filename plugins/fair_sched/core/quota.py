"""Layer: plugin core (no SGLang import). The chunk-level fair prefill policy.

The chunk is the unit of scheduling. Every scheduler pass has a KV budget of `budget_tokens`
new KV slots (SGLang's chunked-prefill size). Within it:

* a request whose whole prompt fits in one chunk ("one-chunk" request) goes first, in arrival
  order, and is prefilled whole in one pass;
* at most one long request is active (partially prefilled) at a time. On a pass where it runs,
  it keeps at least `min_long_tokens` of the budget and the rest is reserved for waiting
  one-chunk requests, which share the pass with it;
* a long request has a turn quota (tokens it may prefill before it must offer the engine back).
  When it has used its quota and one-chunk prompts too large to share the pass beside its
  minimum share are waiting, it yields for exactly one pass at a chunk boundary. It keeps the KV it
  has computed (SGLang's request row holds it; nothing is recomputed) and resumes where it
  stopped. Its quota grows by `quota_growth` with every yield, up to `max_quota_tokens`, and
  after `max_yields` yields it never yields again.
* while other requests are decoding, the long request also sits out one pass (a decode step)
  after every `decode_every_chunks` of its chunks, so their decode is not stalled for the
  whole long prefill. This costs a bounded fraction and does not change its quota.

Why one active long request and not several: long requests compete only with each other for
the part of the budget the one-chunk requests leave; serving them first-come-first-served
(one at a time) gives each long request the smallest mean completion time, whereas sharing
the budget among several (processor sharing) delays all of them. SGLang's single chunked
slot therefore is not what limits fairness here.

* with `short_extra_tokens` > 0 the long request is not cut down at all: waiting one-chunk
  requests ride along its full chunk in up to `short_extra_tokens` extra tokens of that pass
  (a pass then costs the long chunk plus a few short-context tokens, instead of a smaller long
  chunk and one more pass at long context later); only those that do not fit there can make it
  yield (quota rules above).
* with `busy_decode_reqs` > 0, while at least that many requests decode the decode step comes
  after every long chunk (TPOT of many decoding requests is worth a decode step per chunk; with
  few of them, every `decode_every_chunks`).
* with `decode_max_gap_s` > 0 a decode step also comes after any chunk once the last decode is
  that old (long chunks at 6-8K context take ~0.5-0.8 s on this CPU, so "every third chunk" can
  leave a few decoding requests waiting 2 s for a token).
* among waiting long requests, `long_overtake_max` > 0 starts the shortest first (smaller mean
  completion time), but no long request is overtaken by more than `long_overtake_max` younger
  ones; 0 keeps them first-come-first-served.

Starvation bound (`pass_bound`): once a long request of W uncached tokens is active, every
pass either runs at least min(remaining, m) of its tokens (m = the full budget with
`short_extra_tokens`, else `min_long_tokens`) or is a yield; it yields to one-chunk requests at
most `yield_bound(W)` times and to decode at most once per `decode_every_chunks` running passes;
so it completes within R + yield_bound(W) + ceil(R / decode_every_chunks) passes (R decode
passes with `busy_decode_reqs` or `decode_max_gap_s`),
R = ceil(W / m). A waiting long request is started on the first pass in which no long request is
active, behind the older long requests and at most `long_overtake_max` younger (shorter) ones:
`order` puts it right after the one-chunk requests that fit beside its minimum share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

PlanAction = Literal["admit", "run", "yield"]
YieldTo = Literal["decode", "short"]


@dataclass(frozen=True)
class QuotaParams:
    """Policy parameters, in tokens (KV slots)."""

    budget_tokens: int
    """New KV tokens per pass (SGLang's chunked-prefill size)."""
    base_quota_tokens: int
    """Tokens an active long request prefills before its first yield."""
    quota_growth: float
    """Quota multiplier applied after every yield (>= 1)."""
    max_quota_tokens: int
    """Upper limit of the turn quota."""
    max_yields: int
    """After this many yields a long request never yields again (0 disables yielding)."""
    long_min_share: float
    """Fraction of the pass budget the active long request always keeps when it runs."""
    one_chunk_tokens: int = 0
    """Work up to this many tokens counts as a one-chunk request; 0 means budget_tokens."""
    decode_every_chunks: int = 0
    """While requests are decoding, give them one pass after every this many long chunks (0: never)."""
    page_size: int = 1
    short_extra_tokens: int = 0
    """Pass tokens beyond the budget for one-chunk requests riding along a full long chunk (0: they share the budget)."""
    long_overtake_max: int = 0
    """Waiting long requests go shortest first, each overtaken by at most this many younger ones (0: FCFS)."""
    decode_interval_s: float = 0.0
    """With > 0: a decode step comes when the last one is this old (and at least max(decode_every_chunks, 1) chunks ago)."""
    busy_decode_reqs: int = 0
    """While at least this many requests decode, a decode step comes after every long chunk (0: off)."""
    decode_max_gap_s: float = 0.0
    """With > 0: a decode step also comes after any chunk once the last decode is this old (0: off)."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.budget_tokens < 2 * self.page_size:
            raise ValueError(f"budget_tokens must be >= 2 pages ({2 * self.page_size}), got {self.budget_tokens}")
        if self.base_quota_tokens < 1:
            raise ValueError(f"base_quota_tokens must be >= 1, got {self.base_quota_tokens}")
        if not self.quota_growth >= 1.0:
            raise ValueError(f"quota_growth must be >= 1.0, got {self.quota_growth}")
        if self.max_quota_tokens < self.base_quota_tokens:
            raise ValueError(
                f"max_quota_tokens must be >= base_quota_tokens ({self.base_quota_tokens}), got {self.max_quota_tokens}"
            )
        if self.max_yields < 0:
            raise ValueError(f"max_yields must be >= 0, got {self.max_yields}")
        if not 0.0 < self.long_min_share <= 1.0:
            raise ValueError(f"long_min_share must be in (0, 1], got {self.long_min_share}")
        if self.one_chunk_tokens < 0:
            raise ValueError(f"one_chunk_tokens must be >= 0, got {self.one_chunk_tokens}")
        if self.decode_every_chunks < 0:
            raise ValueError(f"decode_every_chunks must be >= 0, got {self.decode_every_chunks}")
        if self.short_extra_tokens < 0:
            raise ValueError(f"short_extra_tokens must be >= 0, got {self.short_extra_tokens}")
        if not self.decode_interval_s >= 0.0:
            raise ValueError(f"decode_interval_s must be >= 0, got {self.decode_interval_s}")
        if self.long_overtake_max < 0:
            raise ValueError(f"long_overtake_max must be >= 0, got {self.long_overtake_max}")
        if self.busy_decode_reqs < 0:
            raise ValueError(f"busy_decode_reqs must be >= 0, got {self.busy_decode_reqs}")
        if not self.decode_max_gap_s >= 0.0:
            raise ValueError(f"decode_max_gap_s must be >= 0, got {self.decode_max_gap_s}")

    @property
    def one_chunk_limit(self) -> int:
        return self.one_chunk_tokens or self.budget_tokens

    @property
    def min_long_tokens(self) -> int:
        """Page-aligned minimum share of the active long request on a running pass."""
        raw = int(self.budget_tokens * self.long_min_share) // self.page_size * self.page_size
        return min(max(raw, self.page_size), self.budget_tokens)

    @property
    def decode_spacing_chunks(self) -> int:
        """Fewest long chunks between two decode steps (0: no decode steps)."""
        if self.busy_decode_reqs or self.decode_max_gap_s > 0:
            return 1
        if self.decode_interval_s > 0:
            return max(self.decode_every_chunks, 1)
        return self.decode_every_chunks

    def spacing_for(self, running_reqs: int | None) -> int:
        """Decode-step spacing in long chunks with `running_reqs` requests decoding (None: unknown)."""
        if self.busy_decode_reqs and running_reqs is not None and running_reqs >= self.busy_decode_reqs:
            return 1
        if self.decode_interval_s > 0:
            return max(self.decode_every_chunks, 1)
        return self.decode_every_chunks

    @property
    def long_run_tokens(self) -> int:
        """Tokens the active long request prefills at least on a running pass (before its last)."""
        return self.budget_tokens if self.short_extra_tokens else self.min_long_tokens

    @property
    def max_pass_tokens(self) -> int:
        """Most new tokens one pass prefills (the budget plus the riding one-chunk requests)."""
        return self.budget_tokens + self.ceil_page(self.short_extra_tokens) if self.short_extra_tokens else self.budget_tokens

    def next_quota(self, quota: int) -> int:
        return min(self.max_quota_tokens, max(quota + 1, math.ceil(quota * self.quota_growth))) if self.quota_growth > 1.0 else quota

    def quota_after(self, yields: int) -> int:
        q = self.base_quota_tokens
        for _ in range(yields):
            q = self.next_quota(q)
        return q

    def ceil_page(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size


def yield_bound(work_tokens: int, params: QuotaParams) -> int:
    """Most yields a long request of `work_tokens` can make: turn i runs at least quota_i tokens,
    and a yield follows a turn only while work remains."""
    done = 0
    yields = 0
    q = params.base_quota_tokens
    while yields < params.max_yields:
        done += q
        if done >= work_tokens:
            break
        yields += 1
        q = params.next_quota(q)
    return yields


def pass_bound(work_tokens: int, params: QuotaParams, first_chunk: int | None = None) -> int:
    """Passes within which an active long request of `work_tokens` completes, counted from the
    pass of its first chunk (see module doc). Give `first_chunk` when that chunk may have been
    smaller than the minimum share (a request truncated into a partly used pass)."""
    m = params.long_run_tokens
    if first_chunk is None or first_chunk >= m:
        run_passes = -(-work_tokens // m)
    else:
        run_passes = 1 + -(-(work_tokens - first_chunk) // m)
    spacing = params.decode_spacing_chunks
    decode_passes = -(-run_passes // spacing) if spacing else 0
    return run_passes + yield_bound(work_tokens, params) + decode_passes


def solo_passes(work_tokens: int, params: QuotaParams) -> int:
    """Passes the request needs alone (whole budget every pass)."""
    return -(-work_tokens // params.budget_tokens)


def stretch_bound(work_tokens: int, params: QuotaParams) -> float:
    """K(W): completion time after activation over solo latency, when a pass costs a fixed part
    plus a part proportional to its new tokens (so a pass of `max_pass_tokens` costs at most
    max_pass_tokens / budget_tokens times a full-budget pass) and a decode step no more than a
    full-budget pass. For other pass costs multiply by max pass cost / full-budget pass cost."""
    ride = params.max_pass_tokens / params.budget_tokens
    return pass_bound(work_tokens, params) / solo_passes(work_tokens, params) * ride


def max_stretch_bound(lo: int, hi: int, params: QuotaParams) -> float:
    """max K(W) over lo <= W <= hi (the stated bound for a workload's long prompts)."""
    return max(stretch_bound(w, params) for w in range(max(lo, 1), hi + 1))


@dataclass(frozen=True)
class WaitingItem:
    """A request in the waiting queue, as the policy sees it."""

    rid: str
    work_tokens: int
    """Tokens still to prefill (prompt minus cached prefix)."""
    seq: int
    """Arrival order (smaller is older)."""


@dataclass
class LongState:
    """The active long request's progress and quota."""

    rid: str
    work_tokens: int
    quota: int
    computed_tokens: int = 0
    turn_used: int = 0
    yields: int = 0
    run_passes: int = 0
    yield_passes: int = 0
    decode_passes: int = 0
    chunks_since_decode: int = 0
    quotas: list[int] = field(default_factory=list)
    """Quota of each turn, in order (the first is the base quota)."""

    @property
    def remaining(self) -> int:
        return max(self.work_tokens - self.computed_tokens, 0)


@dataclass(frozen=True)
class PassPlan:
    action: PlanAction
    """admit: no long request active; run: it runs (with long_limit); yield: it sits this pass out."""
    long_limit: int | None = None
    """Cap on the long request's chunk this pass (None: the whole remaining budget)."""
    yield_to: YieldTo | None = None
    reserved_tokens: int = 0
    """Budget reserved for waiting one-chunk requests."""
    extra_tokens: int = 0
    """Tokens added to this pass's budget for them (`short_extra_tokens`; the long chunk keeps the budget)."""


class FairPolicy:
    """Per-scheduler policy state. Call `plan` exactly once per pass in which a prefill may run."""

    def __init__(self, params: QuotaParams) -> None:
        self.params = params
        self.active: LongState | None = None
        self.finished: list[LongState] = []
        self.total_yields = 0
        self.total_yields_to_decode = 0
        self.last_decode_s = -math.inf
        """Clock of the last pass that decoded (`note_decode`, or a decode yield of `plan`)."""
        self.overtaken: dict[str, int] = {}
        """Waiting long request -> younger long requests started before it."""
        self.total_overtakes = 0
        self._waiting_longs: list[WaitingItem] = []

    def is_one_chunk(self, work_tokens: int) -> bool:
        return work_tokens <= self.params.one_chunk_limit

    # -- ordering --------------------------------------------------------------------------
    def order(self, waiting: Sequence[WaitingItem], budget: int | None = None) -> list[int]:
        """Admission order (indices into `waiting`): one-chunk requests first, oldest first.

        With no long request active, the next long request (the oldest; with `long_overtake_max`
        the shortest, unless an older one was overtaken that often) is placed right after the
        one-chunk requests that fit beside its minimum share, so it starts this pass. `budget`:
        this pass's budget when it is smaller than `budget_tokens` (decode rows riding along).
        """
        idx = sorted(range(len(waiting)), key=lambda i: waiting[i].seq)
        shorts = [i for i in idx if self.is_one_chunk(waiting[i].work_tokens)]
        longs = [i for i in idx if not self.is_one_chunk(waiting[i].work_tokens)]
        self._waiting_longs = [waiting[i] for i in longs]
        if not longs:
            return shorts
        # The next long request leads the longs even while one is active: SGLang frees the chunked
        # slot inside the pass that runs the active one's last chunk, and the first waiting long
        # request is then truncated into what is left of that pass.
        first = self._next_long(longs, waiting)
        longs.remove(first)
        longs.insert(0, first)
        if self.active is not None:
            return shorts + longs
        room = self._budget(budget) - self.params.min_long_tokens
        used = 0
        cut = 0
        for i in shorts:
            charge = self.params.ceil_page(waiting[i].work_tokens)
            if used + charge > room:
                break
            used += charge
            cut += 1
        return shorts[:cut] + longs[:1] + shorts[cut:] + longs[1:]

    def _next_long(self, longs: list[int], waiting: Sequence[WaitingItem]) -> int:
        """Index of the long request to start: the oldest (FCFS), or with `long_overtake_max` the
        shortest unless an older one has been overtaken that many times already."""
        cap = self.params.long_overtake_max
        if not cap:
            return longs[0]
        for i in longs:  # oldest first
            if self.overtaken.get(waiting[i].rid, 0) >= cap:
                return i
        return min(longs, key=lambda i: (waiting[i].work_tokens, waiting[i].seq))

    # -- per pass --------------------------------------------------------------------------
    def _budget(self, budget: int | None) -> int:
        p = self.params
        if budget is None:
            return p.budget_tokens
        return min(max(budget, p.min_long_tokens), p.budget_tokens)

    def note_decode(self, now: float) -> None:
        """A pass decoded the running requests at clock `now` (seconds)."""
        self.last_decode_s = now

    def _decode_due(self, a: LongState, now: float | None, running_reqs: int | None) -> bool:
        p = self.params
        if p.decode_max_gap_s > 0 and now is not None and a.chunks_since_decode >= 1 \
                and now - self.last_decode_s >= p.decode_max_gap_s:
            return True  # the running requests' last token is that old: a step whatever the chunk count
        spacing = p.spacing_for(running_reqs)
        if not spacing or a.chunks_since_decode < spacing:
            return False
        busy = bool(p.busy_decode_reqs) and running_reqs is not None and running_reqs >= p.busy_decode_reqs
        if p.decode_interval_s > 0 and now is not None and not busy:
            return now - self.last_decode_s >= p.decode_interval_s
        return True

    def plan(self, waiting: Sequence[WaitingItem], decode_running: bool, budget: int | None = None,
             now: float | None = None, running_reqs: int | None = None) -> PassPlan:
        """Decide this pass for the active long request (if any). A yield is committed here.
        `budget`: this pass's budget when smaller than `budget_tokens` (decode rows riding along
        take part of it); `now`: the clock in seconds (for `decode_interval_s`); `running_reqs`:
        how many requests decode (for `busy_decode_reqs`); a yield pass gets the whole
        `budget_tokens` (the adapter does not mix decode rows into it), so a blocked one-chunk
        request fits there."""
        a = self.active
        if a is None:
            return PassPlan("admit")
        p = self.params
        shorts = sorted((w for w in waiting if self.is_one_chunk(w.work_tokens)), key=lambda w: w.seq)
        pass_budget = self._budget(budget)
        # Riding along (short_extra_tokens): the long chunk keeps the whole pass budget and the
        # one-chunk requests get tokens on top; else they take budget beyond its minimum share.
        room = p.ceil_page(p.short_extra_tokens) if p.short_extra_tokens else pass_budget - p.min_long_tokens
        reserved = 0
        fitted = 0
        for w in shorts:
            charge = p.ceil_page(w.work_tokens)
            if reserved + charge > room:
                break
            reserved += charge
            fitted += 1
        blocked = fitted < len(shorts)
        if decode_running and self._decode_due(a, now, running_reqs):
            # Decode steps do not wait for the whole long prefill; this costs the long request
            # at most one decode step per `decode_spacing_chunks` chunks (fewer with
            # `decode_interval_s`: only when the running requests' last token is that old)
            # and does not touch its quota.
            a.chunks_since_decode = 0
            if now is not None:
                self.last_decode_s = now
            a.decode_passes += 1
            self.total_yields_to_decode += 1
            return PassPlan("yield", yield_to="decode")
        if blocked and a.turn_used >= a.quota and a.yields < p.max_yields:
            # One-chunk requests too large to share the pass beside the long request's minimum
            # share get a whole pass once it has used its quota; the quota then grows.
            a.yields += 1
            a.yield_passes += 1
            a.turn_used = 0
            a.quota = p.next_quota(a.quota)
            a.quotas.append(a.quota)
            self.total_yields += 1
            return PassPlan("yield", yield_to="short")
        if reserved == 0:
            return PassPlan("run")
        if p.short_extra_tokens:
            return PassPlan("run", long_limit=pass_budget, reserved_tokens=reserved, extra_tokens=reserved)
        limit = (pass_budget - reserved) // p.page_size * p.page_size
        return PassPlan("run", long_limit=max(limit, p.page_size), reserved_tokens=reserved)

    # -- progress --------------------------------------------------------------------------
    def start_long(self, rid: str, work_tokens: int) -> LongState:
        """A long request received its first chunk (it becomes the active one)."""
        if self.active is not None and self.active.rid != rid:
            raise RuntimeError(f"long request {rid!r} started while {self.active.rid!r} is active")
        if self.active is None:
            self.active = LongState(rid, work_tokens, self.params.base_quota_tokens)
            self.active.quotas.append(self.active.quota)
            started = next((w for w in self._waiting_longs if w.rid == rid), None)
            still = {w.rid for w in self._waiting_longs if w.rid != rid}
            self.overtaken = {r: n for r, n in self.overtaken.items() if r in still}
            if started is not None:
                for w in self._waiting_longs:
                    if w.seq < started.seq:
                        self.overtaken[w.rid] = self.overtaken.get(w.rid, 0) + 1
                        self.total_overtakes += 1
        return self.active

    def record_run(self, rid: str, tokens: int) -> None:
        """The active long request prefilled `tokens` new tokens this pass."""
        a = self.active
        if a is None or a.rid != rid:
            raise RuntimeError(f"record_run for {rid!r}, active is {a.rid if a else None!r}")
        if tokens <= 0:
            raise ValueError(f"record_run tokens must be > 0, got {tokens}")
        a.computed_tokens += tokens
        a.turn_used += tokens
        a.run_passes += 1
        a.chunks_since_decode += 1

    def finish_long(self, rid: str) -> LongState | None:
        """The active long request's prefill is complete (or it left: abort, retraction)."""
        a = self.active
        if a is None or a.rid != rid:
            return None
        self.active = None
        self.finished.append(a)
        del self.finished[:-64]
        return a
