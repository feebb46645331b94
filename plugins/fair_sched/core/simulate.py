"""Layer: plugin core (no SGLang import). A pass-level model of SGLang's prefill admission, driven
by `FairPolicy`, for property tests and quick what-if runs.

It mirrors the engine rules the adapter relies on: the active long request is offered the
budget first (capped by the plan's limit), waiting requests are then tried in the policy's
order, a request that does not fit whole is truncated only when no long request is active
(one partially prefilled request at most), and the first request that cannot be admitted
ends the pass (SGLang's adder breaks there too). A yield to decode prefills nothing. With
`max_partial` > 1 a suspended request (yield to "partial") waits aside with its progress, the
pass may truncate a newcomer, and a suspended request resumes when none is active (as the
adapter puts it back as `chunked_req`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, WaitingItem


@dataclass
class SimRequest:
    rid: str
    work_tokens: int
    arrival_pass: int
    arrival_clock: int = 0
    """Prefill tokens processed before it arrived (the policy's clock)."""
    chunks: list[int] = field(default_factory=list)
    """Tokens prefilled for this request, one entry per pass that computed some."""
    started_pass: int | None = None
    done_pass: int | None = None
    active_pass: int | None = None
    """First pass in which it was the active long request."""

    @property
    def computed_tokens(self) -> int:
        return sum(self.chunks)


@dataclass
class SimResult:
    requests: dict[str, SimRequest]
    passes: int
    yields: int
    prefilled: list[list[str]] = field(default_factory=list)
    """Requests that computed tokens in each pass (empty for a decode yield)."""
    partial_peak: int = 0
    """Most requests partially prefilled at once (active and suspended)."""
    long_partial_peak: int = 0
    """Most of those with more than `long_threshold` of work at once."""
    pass_end_s: list[float] = field(default_factory=list)
    """Simulated clock at the end of each pass (with a `cost` model; else pass k ends at k + 1)."""

    def start_s(self, k: int) -> float:
        return self.pass_end_s[k - 1] if k > 0 else 0.0


def simulate(
    policy: FairPolicy,
    arrivals: Sequence[Sequence[tuple[str, int]]],
    decode_running: Sequence[int],
    max_passes: int = 100_000,
    cost: Callable[[int, bool], float] | None = None,
) -> SimResult:
    """Run until every request is prefilled. `arrivals[k]` arrive before pass k;
    `decode_running[k % len]` is how many requests decode in pass k (a bool: some or none). `cost(prefilled_tokens,
    decode)` is the duration of a pass (a decode step when decode is True and nothing was
    prefilled; decode requests also ride along any prefill pass)."""
    p = policy.params
    reqs: dict[str, SimRequest] = {}
    waiting: list[str] = []
    seq: dict[str, int] = {}
    k = 0
    prefilled: list[list[str]] = []
    clock: list[float] = []
    now = 0.0
    processed = 0
    peak = long_peak = 0
    while k < max_passes:
        ran: list[str] = []
        prefilled.append(ran)
        if k < len(arrivals):
            for rid, work in arrivals[k]:
                reqs[rid] = SimRequest(rid, work, k, processed)
                seq[rid] = len(seq)
                waiting.append(rid)
        elif not waiting and policy.active is None and not policy.suspended:
            break
        if policy.active is None:
            policy.resume()
        items = [WaitingItem(r, reqs[r].work_tokens - reqs[r].computed_tokens, seq[r], reqs[r].arrival_clock) for r in waiting]
        running = int(decode_running[k % len(decode_running)]) if decode_running else 0
        decode = running > 0
        plan = policy.plan(items, decode, now=now, running_reqs=running)
        budget = p.budget_tokens
        used = 0
        active = policy.active
        if plan.action == "yield" and plan.yield_to == "decode":
            now += cost(0, True) if cost else 1.0
            clock.append(now)
            k += 1
            continue
        if active is not None and plan.action == "run":
            req = reqs[active.rid]
            if req.active_pass is None:
                req.active_pass = k
            cap = budget if plan.long_limit is None else min(budget, plan.long_limit)
            take = min(req.work_tokens - req.computed_tokens, cap)
            req.chunks.append(take)
            ran.append(req.rid)
            policy.record_run(req.rid, take)
            budget -= take
            used += take
            budget += plan.extra_tokens  # riding earlier-key requests get tokens beyond the budget
            if req.computed_tokens >= req.work_tokens:
                req.done_pass = k
                policy.finish_long(req.rid)
        parked = plan.action == "yield" and plan.yield_to == "short"
        if plan.action == "yield":
            budget += plan.extra_tokens  # a yield pass: the whole pass plus the riders' extra, whole requests only
        for i in policy.order(items):
            if budget < p.page_size:
                break
            rid = items[i].rid
            req = reqs[rid]
            need = req.work_tokens - req.computed_tokens
            if p.ceil_page(need) <= budget:
                take = need
            elif policy.active is None and not parked and (not policy.suspended or plan.yield_to == "partial"):
                # As in SGLang: the slot is free again once the active request's last chunk ran
                # (with requests suspended, only on the pass planned for the newcomer).
                take = budget // p.page_size * p.page_size
            else:
                break
            req.chunks.append(take)
            ran.append(rid)
            req.started_pass = k
            budget -= p.ceil_page(take)
            used += take
            waiting.remove(rid)
            if take < need:
                policy.start_long(rid, need)
                policy.record_run(rid, take)
                req.active_pass = k
            else:
                req.done_pass = k
        n_partial, n_long = policy.partials()
        peak, long_peak = max(peak, n_partial), max(long_peak, n_long)
        if not used and decode:
            policy.note_decode(now)  # nothing to prefill: the pass decodes
        elif used:
            policy.note_prefill()
        processed += used
        now += (cost(used, decode) if used else cost(0, decode)) if cost else 1.0
        clock.append(now)
        k += 1
    del prefilled[k:]
    del clock[k:]
    return SimResult(reqs, k, policy.total_yields, prefilled, pass_end_s=clock, partial_peak=peak, long_partial_peak=long_peak)
