"""Layer: plugin core (no SGLang import). The chunk-level fair prefill policy.

Every scheduler pass has a KV budget of `budget_tokens` new KV slots (SGLang's chunked-prefill
size). The rule is one order over all requests with prefill work left, by a static key

    key(r) = clock(r) + age_weight x work(r)

`clock(r)` is the engine's count of prefill tokens processed when r arrived (SGLang keeps it:
`Scheduler.processed_tokens_counter`, `Req.arrival_processed_tokens`, the clock of its `hrrn`
policy) and `work(r)` its uncached prompt. Smaller keys go first: earliest deadline first with
deadline = arrival + age_weight x size, on a clock that only moves with prefill work. Two
waiting requests keep their relative order forever (both age at the same rate), so a request of
work w is overtaken only by requests that arrive before the engine has processed
age_weight x w more tokens; age_weight -> infinity is shortest-prefill-first, 0 is FCFS. There
is no "short" or "long" class and no threshold tied to the chunk size.

SGLang keeps one partially prefilled request (`Scheduler.chunked_req`, the "active" request
here). While one is active:

* waiting requests with a smaller key than the active one ride along its chunk, whole, in up to
  `short_extra_tokens` tokens beyond the budget (the active chunk is not cut down: a cut-down
  chunk at long context means one more expensive pass later);
* when an earlier-key request does not fit there but would fit in a whole pass (budget + extra),
  the active request yields one pass at a chunk boundary once it has used its turn quota. It
  keeps its KV and resumes where it stopped. The quota grows by `quota_growth` with every yield,
  up to `max_quota_tokens`, and after `max_yields` yields it never yields again;
* while other requests are decoding it also sits out one pass (a decode step) after every
  `decode_every_chunks` chunks (every chunk while >= `busy_decode_reqs` decode, or once the last
  decode is `decode_max_gap_s` old); this does not touch its quota.
* an earlier-key request larger than a whole pass waits for the active request to finish, unless
  `max_partial` > 1: then, once the active request has used its turn quota (the same quota and
  `max_yields` as a yield), it is suspended with its KV and the pass may truncate the earlier-key
  request, which becomes the active one. At most `max_partial` requests are partially prefilled
  (the active one and the suspended ones), at most `max_long_partial` of them with more than
  `long_partial_tokens` of work. When no request is active, the suspended one with the smallest
  key resumes where it stopped. SGLang runs one partial chunk per pass, so partial prefills take
  turns rather than share a pass (`core/partial.py` plans shared passes for an engine that can).

Starvation bounds (property-tested in tests/unit/test_fair_sched_core.py on a simulated clock):

* `pass_bound`: once a request of W uncached tokens is active, it completes within
  R + yield_bound(W) + ceil(R / spacing) passes, R = ceil(W / m) (m = the budget with riding,
  else `min_long_tokens`), spacing = the decode-step spacing (1 with `busy_decode_reqs` or
  `decode_max_gap_s`).
* `overtake window`: no request that arrived after the clock passed key(r) is served before r
  (except beside it, in budget r could not use), so the prefill work ahead of r is the work of
  requests present at its arrival plus what arrives within age_weight x W processed tokens.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Sequence

TIME_SHARE_MAX_RUN = 16
"""`decode_time_share`: most decode steps in a row between two prefill passes (keeps the pass bound)."""
DECODE_SAMPLES = 9
"""Measured decode steps whose median is the decode-step estimate (`FairPolicy.decode_cost_s`)."""

PlanAction = Literal["admit", "run", "yield"]
YieldTo = Literal["decode", "short", "partial"]


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
    decode_every_chunks: int = 0
    """While requests are decoding, give them one pass after every this many long chunks (0: never)."""
    page_size: int = 1
    short_extra_tokens: int = 0
    """Pass tokens beyond the budget for one-chunk requests riding along a full long chunk (0: they share the budget)."""
    age_weight: float = 1.0
    """key = arrival clock (prefill tokens processed) + age_weight x work; smaller first (0: FCFS)."""
    decode_interval_s: float = 0.0
    """With > 0: a decode step comes when the last one is this old (and at least max(decode_every_chunks, 1) chunks ago)."""
    busy_decode_reqs: int = 0
    """While at least this many requests decode, a decode step comes after every long chunk (0: off)."""
    decode_max_gap_s: float = 0.0
    """With > 0: a decode step also comes after any chunk once the last decode is this old (0: off)."""
    decode_share: float = 0.0
    """With > 0: while prefills wait, a decode step comes once the prefill time since the last one is
    (1 - share) / share x the measured decode-step time (decode steps take about this share of the time)."""
    decode_time_share: float = 0.0
    """With > 0: while prompts wait, decode steps take at least this share of the time since prompts
    began waiting, several in a row when they fall behind (`decode_share` takes at most one per
    prefill pass); 0: off."""
    max_partial: int = 1
    """Requests partially prefilled at once (the active one and the suspended ones; 1: SGLang's one)."""
    max_long_partial: int = 1
    """Of those, at most this many with more than `long_partial_tokens` of work."""
    long_partial_tokens: int = 0
    """Work above which a partial prefill counts as long (0: 16 budgets)."""

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
        if self.decode_every_chunks < 0:
            raise ValueError(f"decode_every_chunks must be >= 0, got {self.decode_every_chunks}")
        if self.short_extra_tokens < 0:
            raise ValueError(f"short_extra_tokens must be >= 0, got {self.short_extra_tokens}")
        if not self.decode_interval_s >= 0.0:
            raise ValueError(f"decode_interval_s must be >= 0, got {self.decode_interval_s}")
        if not self.age_weight >= 0.0:
            raise ValueError(f"age_weight must be >= 0, got {self.age_weight}")
        if self.busy_decode_reqs < 0:
            raise ValueError(f"busy_decode_reqs must be >= 0, got {self.busy_decode_reqs}")
        if not self.decode_max_gap_s >= 0.0:
            raise ValueError(f"decode_max_gap_s must be >= 0, got {self.decode_max_gap_s}")
        if not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {self.decode_share}")
        if not 0.0 <= self.decode_time_share < 1.0:
            raise ValueError(f"decode_time_share must be in [0, 1), got {self.decode_time_share}")
        if self.max_partial < 1:
            raise ValueError(f"max_partial must be >= 1, got {self.max_partial}")
        if not 1 <= self.max_long_partial <= self.max_partial:
            raise ValueError(f"max_long_partial must be in [1, max_partial={self.max_partial}], got {self.max_long_partial}")
        if self.long_partial_tokens < 0:
            raise ValueError(f"long_partial_tokens must be >= 0, got {self.long_partial_tokens}")

    @property
    def min_long_tokens(self) -> int:
        """Page-aligned minimum share of the active long request on a running pass."""
        raw = int(self.budget_tokens * self.long_min_share) // self.page_size * self.page_size
        return min(max(raw, self.page_size), self.budget_tokens)

    @property
    def decode_spacing_chunks(self) -> int:
        """Fewest long chunks between two decode steps (0: no decode steps)."""
        if self.busy_decode_reqs or self.decode_max_gap_s > 0 or self.decode_share > 0:
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
        return self.min_long_tokens

    @property
    def max_pass_tokens(self) -> int:
        """Most new tokens one pass prefills (the budget plus the riding one-chunk requests)."""
        return self.budget_tokens + self.ceil_page(self.short_extra_tokens) if self.short_extra_tokens else self.budget_tokens

    @property
    def long_threshold(self) -> int:
        """Work (tokens) above which a partial prefill counts as long."""
        return self.long_partial_tokens or 16 * self.budget_tokens

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
    yields = yield_bound(work_tokens, params)
    # Decode steps count every prefill pass (its own and the yields), not only its chunks.
    decode_passes = -(-(run_passes + yields) // spacing) if spacing else 0
    if params.decode_time_share > 0:  # up to TIME_SHARE_MAX_RUN decode steps after each prefill pass
        decode_passes = max(decode_passes, (run_passes + yields) * TIME_SHARE_MAX_RUN)
    return run_passes + yields + decode_passes


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
    seq: float
    """Arrival order (smaller is older; ties of the key go to the older request)."""
    clock: int = 0
    """Prefill tokens the engine had processed when the request arrived (SGLang: arrival_processed_tokens)."""


def order_key(item: WaitingItem, params: QuotaParams) -> tuple[float, float]:
    """The policy's static key (see module doc): arrival clock + age_weight x work, then age."""
    return (item.clock + params.age_weight * item.work_tokens, item.seq)


@dataclass
class LongState:
    """The active (partially prefilled) request's progress and quota."""

    rid: str
    work_tokens: int
    quota: int
    key: float = math.inf
    """Its order key, fixed when it started."""
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
    """admit: no request active; run: the active one runs (with long_limit); yield: it sits this pass out."""
    long_limit: int | None = None
    """Cap on the active request's chunk this pass (None: the whole remaining budget)."""
    yield_to: YieldTo | None = None
    reserved_tokens: int = 0
    """Budget reserved for waiting earlier-key requests."""
    extra_tokens: int = 0
    """Tokens added to this pass's budget for them (`short_extra_tokens`; the active chunk keeps the budget)."""


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
        self.prefills_since_decode = 0
        """Prefill passes since the last decode (decode steps are spaced in prefill passes)."""
        self.decode_cost_s: float | None = None
        """A decode step's duration (with `decode_share`): the median of the last
        DECODE_SAMPLES measured steps. A median, because an interval between two plan calls can
        also hold time the scheduler spent idle or in passes it did not plan (the moving average
        this replaced read many times the step: `decode_step_ms` in
        benchmarks/results/fair_sched/gpu_family_*_8l_h100.json)."""
        self._decode_samples: deque[float] = deque(maxlen=DECODE_SAMPLES)
        self._clean_only = False
        """Under the one-pass lag, once an interval labelled decode also ended in a decode launch,
        `_decode_samples` keeps only such intervals: a prefill launch can block until its own pass
        ends (a host sync), and the interval then holds that prefill pass too (15-17 ms read for
        3-6 ms steps on an H100 in gpu_loads_2048_8l_h100.json)."""
        self.last_decode_end_s = -math.inf
        self._keys: dict[str, float] = {}
        """Keys of the requests seen by the last `order` call (for `start_long`)."""
        self.suspended: list[LongState] = []
        """Partially prefilled requests set aside for an earlier-key one (`max_partial` > 1)."""
        self.waiting_s = {"prefill": 0.0, "decode": 0.0}
        """Time spent prefilling and decoding while prompts waited, since the start (reported: the
        decode share a `decode_time_share` would compete with)."""
        self._share_base = (0.0, 0.0)
        """`waiting_s` (prefill, decode) when the `decode_time_share` account last restarted."""
        self._last_plan_s: float | None = None
        self._pass_kind: str | None = None
        """Kind of the pass planned at the last plan call ("prefill", "decode"; set by note_*)."""
        self._prev_kind: str | None = None
        """Kind of the pass planned at the plan call before it."""
        self.timing_lag = 0
        """Which pass the time between two plan calls measures (0 or 1): 0, the one planned at the
        first of them; 1, the one before it. SGLang's overlap scheduler on an asynchronous device (a GPU)
        launches pass i and then waits for pass i-1, so the next plan call comes when pass i-1
        ends (set by the adapter)."""
        self.decode_run = 0
        """Decode steps in a row since the last prefill pass (at most TIME_SHARE_MAX_RUN)."""

    def key(self, item: WaitingItem) -> tuple[float, float]:
        return order_key(item, self.params)

    # -- ordering --------------------------------------------------------------------------
    def order(self, waiting: Sequence[WaitingItem], budget: int | None = None) -> list[int]:
        """Admission order (indices into `waiting`): by key, smallest first. SGLang admits whole
        requests in this order and truncates the first that does not fit when no request is
        active (it becomes the active one), so the same order serves both cases. `budget` is
        accepted for symmetry with `plan` (the order does not depend on it)."""
        del budget
        keys = [self.key(w) for w in waiting]
        self._keys = {w.rid: k[0] for w, k in zip(waiting, keys)}
        return sorted(range(len(waiting)), key=lambda i: keys[i])

    # -- per pass --------------------------------------------------------------------------
    def _budget(self, budget: int | None) -> int:
        p = self.params
        if budget is None:
            return p.budget_tokens
        return min(max(budget, p.min_long_tokens), p.budget_tokens)

    def note_decode(self, now: float) -> None:
        """A pass decoded the running requests at clock `now` (seconds)."""
        self.last_decode_s = now
        self.prefills_since_decode = 0
        self._pass_kind = "decode"

    def note_unplanned_decode(self, now: float, waiting: bool) -> None:
        """The scheduler decoded at clock `now` without calling `plan` (SGLang's
        `--prefill-decode-interval` defers prefill for some rounds after each prefill pass), with
        requests `waiting` or not: the time since the last plan call is read as at a plan call,
        and the round counts as a decode step, so the decode rules do not add one of their own
        right after it."""
        self._tick(now, waiting)
        self.note_decode(now)

    def note_prefill(self) -> None:
        """A pass prefilled something (any request): it counts toward the next decode step."""
        self.prefills_since_decode += 1
        self._pass_kind = "prefill"
        self.decode_run = 0

    def _clock(self, now: float | None, prompts_wait: bool) -> None:
        """The time since the last plan call measured one pass (`timing_lag` says which): a decode
        step's feeds the decode-cost estimate, and either kind's goes to `waiting_s` while prompts
        wait (`decode_time_share`'s account is the part since its last restart)."""
        if now is None:
            return
        kind = self._prev_kind if self.timing_lag else self._pass_kind
        if self._last_plan_s is not None and kind is not None:
            took = max(now - self._last_plan_s, 0.0)
            if kind == "decode":
                clean = not self.timing_lag or self._pass_kind == "decode"
                if clean and not self._clean_only:
                    self._clean_only = True
                    self._decode_samples.clear()
                if clean or not self._clean_only:
                    self._decode_samples.append(took)
                self.decode_cost_s = statistics.median(self._decode_samples)
                self.last_decode_end_s = now
            if prompts_wait:
                self.waiting_s[kind] += took
        self._last_plan_s = now
        self._prev_kind, self._pass_kind = self._pass_kind, None

    def _tick(self, now: float | None, waiting: bool) -> bool:
        """A scheduling round at clock `now` (planned or not), with requests `waiting` or not:
        time the pass before it and restart the `decode_time_share` account when no prompt waits.
        Returns whether prompts wait (waiting, partially prefilled or suspended)."""
        prompts_wait = waiting or self.active is not None or bool(self.suspended)
        self._clock(now, prompts_wait)
        if self.params.decode_time_share > 0 and not prompts_wait:
            self._share_base = (self.waiting_s["prefill"], self.waiting_s["decode"])
        return prompts_wait

    def _share_account(self) -> tuple[float, float]:
        """(prefill, decode) seconds in `waiting_s` since the `decode_time_share` account restarted."""
        return self.waiting_s["prefill"] - self._share_base[0], self.waiting_s["decode"] - self._share_base[1]

    @property
    def busy_s(self) -> dict[str, float]:
        """Time spent prefilling and decoding since prompts began waiting (`decode_time_share`)."""
        prefill, decode = self._share_account()
        return {"prefill": prefill, "decode": decode}

    def _time_share_due(self) -> bool:
        share = self.params.decode_time_share
        if share <= 0 or self.decode_run >= TIME_SHARE_MAX_RUN:
            return False
        prefill, decode = self._share_account()
        return decode < share * (prefill + decode)

    def _decode_due(self, now: float | None, running_reqs: int | None) -> bool:
        p = self.params
        n = self.prefills_since_decode
        if p.decode_share > 0 and now is not None and n >= 1:
            if self.decode_cost_s is None:
                return True  # measure one
            return now - self.last_decode_end_s >= self.decode_cost_s * (1.0 - p.decode_share) / p.decode_share
        if p.decode_max_gap_s > 0 and now is not None and n >= 1 \
                and now - self.last_decode_s >= p.decode_max_gap_s:
            return True  # the running requests' last token is that old: a step whatever the pass count
        spacing = p.spacing_for(running_reqs)
        if not spacing or n < spacing:
            return False
        busy = bool(p.busy_decode_reqs) and running_reqs is not None and running_reqs >= p.busy_decode_reqs
        if p.decode_interval_s > 0 and now is not None and not busy:
            return now - self.last_decode_s >= p.decode_interval_s
        return True

    def _fitting(self, items: Sequence[WaitingItem], room: int) -> tuple[int, int]:
        """(how many of `items`, in order, fit whole in `room`; their page-rounded tokens)."""
        used = 0
        n = 0
        for w in items:
            charge = self.params.ceil_page(w.work_tokens)
            if used + charge > room:
                break
            used += charge
            n += 1
        return n, used

    def plan(self, waiting: Sequence[WaitingItem], decode_running: bool, budget: int | None = None,
             now: float | None = None, running_reqs: int | None = None,
             suspend_room: int | None = None) -> PassPlan:
        """Decide this pass for the active request (if any). A yield is committed here.
        `budget`: this pass's budget when smaller than `budget_tokens` (decode rows riding along
        take part of it); `now`: the clock in seconds (for the decode clocks); `running_reqs`:
        how many requests decode (for `busy_decode_reqs`); `suspend_room`: KV tokens the engine can
        give a newcomer beside everything held now (None: no limit). The active request is
        suspended (keeping its KV) for a larger earlier-key one only if that newcomer's whole
        remaining prompt fits there: one that did not could stall half-prefilled beside the
        suspended request's KV, with neither able to go on; at 0 or below nothing is suspended."""
        p = self.params
        a = self.active
        prompts_wait = self._tick(now, bool(waiting))
        if decode_running and (self._decode_due(now, running_reqs) or (prompts_wait and self._time_share_due())):
            # Decode steps do not wait for the prefills (SGLang decodes only in passes without
            # one): one after every `decode_every_chunks` prefill passes, whoever they served.
            # The active request's quota is untouched.
            if now is not None:
                self.note_decode(now)
            self.prefills_since_decode = 0
            self.decode_run += 1
            if a is not None:
                a.decode_passes += 1
                a.chunks_since_decode = 0
            self.total_yields_to_decode += 1
            return PassPlan("yield", yield_to="decode")
        if a is None:
            return PassPlan("admit")
        earlier = sorted((w for w in waiting if self.key(w)[0] < a.key), key=self.key)
        pass_budget = self._budget(budget)
        # Riding along (short_extra_tokens): the active chunk keeps the whole pass budget and the
        # earlier-key requests get tokens on top; else they take budget beyond its minimum share.
        # Earlier-key requests first take the active chunk's budget down to its minimum share (a
        # smaller chunk makes the pass, and so their first token, come sooner), then up to
        # `short_extra_tokens` beyond the budget (riding along).
        cut_room = max(pass_budget - p.min_long_tokens, 0)
        extra = p.ceil_page(p.short_extra_tokens)
        fitted, reserved = self._fitting(earlier, cut_room + extra)
        # A yield pass gives them the whole pass (budget + extra), whole requests only.
        helps = self._fitting(earlier, p.budget_tokens + p.ceil_page(p.short_extra_tokens))[0] > fitted
        turn_over = a.turn_used >= a.quota and a.yields < p.max_yields
        if helps and turn_over:
            self._yielded(a)
            return PassPlan("yield", yield_to="short", extra_tokens=p.ceil_page(p.short_extra_tokens))
        if not helps and fitted < len(earlier) and turn_over \
                and (suspend_room is None or earlier[fitted].work_tokens <= suspend_room) \
                and self._may_suspend(earlier[fitted]):
            # The first earlier-key request that cannot ride is larger than a whole pass: the
            # active request steps aside (keeping its KV) and this pass may truncate that one.
            self._yielded(a)
            self.suspended.append(a)
            self.active = None
            return PassPlan("yield", yield_to="partial", extra_tokens=p.ceil_page(p.short_extra_tokens))
        if reserved == 0:
            return PassPlan("run")
        cut = min(reserved, cut_room)
        limit = max((pass_budget - cut) // p.page_size * p.page_size, p.page_size)
        return PassPlan("run", long_limit=limit, reserved_tokens=reserved, extra_tokens=max(reserved - (pass_budget - limit), 0))

    def _yielded(self, a: LongState) -> None:
        p = self.params
        a.yields += 1
        a.yield_passes += 1
        a.turn_used = 0
        a.quota = p.next_quota(a.quota)
        a.quotas.append(a.quota)
        self.total_yields += 1

    def partials(self) -> tuple[int, int]:
        """(requests partially prefilled now: the active one and the suspended ones; how many of
        them are long, i.e. more than `long_threshold` of work)."""
        both = [x for x in (self.active, *self.suspended) if x is not None]
        return len(both), sum(1 for x in both if x.work_tokens > self.params.long_threshold)

    def _may_suspend(self, newcomer: WaitingItem) -> bool:
        """Room for one more partial prefill (`max_partial`, `max_long_partial`) if the active
        request steps aside for `newcomer`."""
        p = self.params
        n, longs = self.partials()
        return n < p.max_partial and (newcomer.work_tokens <= p.long_threshold or longs < p.max_long_partial)

    def resume(self) -> LongState | None:
        """No request is active: the suspended one with the smallest key becomes active again
        (its KV kept; it resumes where it stopped). None when nothing is suspended."""
        if self.active is not None or not self.suspended:
            return None
        best = min(self.suspended, key=lambda x: x.key)
        self.suspended.remove(best)
        self.active = best
        return best

    # -- progress --------------------------------------------------------------------------
    def start_long(self, rid: str, work_tokens: int, key: float | None = None) -> LongState:
        """A request received its first chunk without finishing (it becomes the active one).
        `key`: its order key (default: the one the last `order` call computed for it)."""
        if self.active is not None and self.active.rid != rid:
            raise RuntimeError(f"request {rid!r} started while {self.active.rid!r} is active")
        if self.active is None:
            # Unknown (never ordered): every waiting request counts as earlier, the safe side.
            k = key if key is not None else self._keys.get(rid, math.inf)
            self.active = LongState(rid, work_tokens, self.params.base_quota_tokens, key=k)
            self.active.quotas.append(self.active.quota)
        return self.active

    def record_run(self, rid: str, tokens: int) -> None:
        """The active request prefilled `tokens` new tokens this pass."""
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
        """The active request's prefill is complete (or it left: abort, retraction); also for a
        suspended one that left."""
        a = self.active
        if a is None or a.rid != rid:
            for x in self.suspended:
                if x.rid == rid:
                    self.suspended.remove(x)
                    return x
            return None
        self.active = None
        self.finished.append(a)
        del self.finished[:-64]
        return a
