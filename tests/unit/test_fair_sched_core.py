"""Unit and property tests of the fair_sched policy core (no SGLang)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.fair_sched.core.quota import (
    TIME_SHARE_MAX_RUN,
    FairPolicy,
    PassPlan,
    QuotaParams,
    WaitingItem,
    max_stretch_bound,
    pass_bound,
    solo_passes,
    stretch_bound,
    yield_bound,
)
from kllm_plugins.plugins.fair_sched.core.partial import Candidate, PartialParams, candidate_key, plan_pass
from kllm_plugins.plugins.fair_sched.core.simulate import simulate


def params(**kw: object) -> QuotaParams:
    base: dict[str, object] = dict(
        budget_tokens=128, base_quota_tokens=128, quota_growth=1.5, max_quota_tokens=512,
        max_yields=64, long_min_share=0.25, decode_every_chunks=0,
    )
    base.update(kw)
    return QuotaParams(**base)  # type: ignore[arg-type]


def test_order_is_by_arrival_clock_plus_age_weight_times_work() -> None:
    pol = FairPolicy(params(age_weight=2.0))
    # keys: L 0 + 2 x 900 = 1800; s 1000 + 2 x 60 = 1120; t 1700 + 2 x 60 = 1820; old 0 + 2 x 500 = 1000
    waiting = [WaitingItem("L", 900, 0, 0), WaitingItem("s", 60, 1, 1000), WaitingItem("t", 60, 2, 1700),
               WaitingItem("old", 500, 3, 0)]
    assert [waiting[i].rid for i in pol.order(waiting)] == ["old", "s", "L", "t"]
    # age_weight 0 is FCFS by arrival clock (ties: arrival order); a huge one is shortest first.
    assert [waiting[i].rid for i in FairPolicy(params(age_weight=0.0)).order(waiting)] == ["L", "old", "s", "t"]
    assert [waiting[i].rid for i in FairPolicy(params(age_weight=1e6)).order(waiting)] == ["s", "t", "old", "L"]


@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(0, 50_000)), min_size=2, max_size=8),
       st.floats(0.0, 64.0), st.integers(0, 10**6))
def test_relative_order_of_waiting_requests_never_changes_as_the_clock_advances(
        reqs: list[tuple[int, int]], age: float, later: int) -> None:
    """Keys are static, so an order computed now holds later; a request is overtaken only by
    requests whose key is smaller, i.e. that arrived before the clock passed its key."""
    pol = FairPolicy(params(age_weight=age))
    items = [WaitingItem(f"r{i}", w, i, c) for i, (w, c) in enumerate(reqs)]
    first = pol.order(items)
    assert pol.order(items) == first
    newcomer = WaitingItem("new", 1, len(items), max(c + int(age * w) for w, c in reqs) + 1 + later)
    assert pol.order(items + [newcomer])[-1] == len(items)  # arrived after every key: last


def test_earlier_key_requests_cut_the_partial_chunk_then_ride_beyond_the_budget() -> None:
    pol = FairPolicy(params(page_size=16, short_extra_tokens=128, age_weight=1.0))
    pol.start_long("L", 2000, key=2000.0)
    early = [WaitingItem("a", 20, 0, 0), WaitingItem("b", 40, 1, 0), WaitingItem("c", 50, 2, 0)]
    plan = pol.plan(early, decode_running=False)
    # ceil-paged 32 + 48 + 64 = 144: 96 come out of the chunk (down to its 32-token share), 48 ride on top.
    assert (plan.action, plan.long_limit, plan.reserved_tokens, plan.extra_tokens) == ("run", 32, 144, 48)
    # Later keys than the partial request's do not ride: it keeps the whole budget.
    late = [WaitingItem("z", 20, 0, 5000)]
    assert pol.plan(late, decode_running=False) == PassPlan("run")


def test_partial_request_yields_only_when_a_whole_pass_helps_and_after_its_quota() -> None:
    pol = FairPolicy(params(short_extra_tokens=0, age_weight=1.0))
    pol.start_long("L", 3000, key=3000.0)
    big = [WaitingItem("s", 120, 0, 0)]  # 120 > 128 - 32: cannot share, fits a whole pass
    pol.record_run("L", 64)
    assert pol.plan(big, decode_running=False).action == "run"  # 64 < quota 128
    pol.record_run("L", 64)
    plan = pol.plan(big, decode_running=False)
    assert (plan.action, plan.yield_to) == ("yield", "short")
    assert pol.active is not None and pol.active.quota == 192 and pol.active.turn_used == 0
    # A request larger than a whole pass cannot be helped by a yield (SGLang holds one partial).
    huge = [WaitingItem("h", 500, 0, 0)]
    pol.record_run("L", 200)
    assert pol.plan(huge, decode_running=False).action == "run"


def test_a_larger_earlier_key_request_suspends_the_partial_one_within_the_caps() -> None:
    """max_partial 2: once its quota is used, the partial request steps aside (KV kept) for an
    earlier-key request larger than a whole pass, which may then be truncated and become active;
    the suspended one resumes, with its progress, when none is active. No suspension past the caps."""
    pol = FairPolicy(params(short_extra_tokens=0, age_weight=1.0, max_partial=2))
    pol.start_long("L", 3000, key=3000.0)
    medium = [WaitingItem("m", 500, 0, 0)]  # larger than a whole pass (128): a yield cannot help
    pol.record_run("L", 64)
    assert pol.plan(medium, decode_running=False).action == "run"  # 64 < quota 128
    pol.record_run("L", 64)
    plan = pol.plan(medium, decode_running=False)
    assert (plan.action, plan.yield_to) == ("yield", "partial")
    assert pol.active is None and [x.rid for x in pol.suspended] == ["L"] and pol.suspended[0].computed_tokens == 128
    pol.start_long("m", 500, key=500.0)
    # two partials now: no third, and the active medium is not set aside for another one
    pol.record_run("m", 128)
    assert pol.plan([WaitingItem("n", 400, 1, 0)], decode_running=False).action == "run"
    pol.finish_long("m")
    back = pol.resume()
    assert back is not None and back.rid == "L" and back.computed_tokens == 128 and pol.suspended == []
    # not while the engine's KV cannot hold both, nor for a second long one with max_long_partial 1
    pol.record_run("L", 300)
    assert pol.plan(medium, decode_running=False, suspend_room=0).action == "run"
    assert pol.plan([WaitingItem("h", 2100, 0, 0)], decode_running=False).action == "run"  # 2100 > 16 budgets
    assert pol.plan(medium, decode_running=False).yield_to == "partial"
    # max_partial 1 (the default) never suspends
    one = FairPolicy(params(short_extra_tokens=0, age_weight=1.0))
    one.start_long("L", 3000, key=3000.0)
    one.record_run("L", 128)
    assert one.plan(medium, decode_running=False).action == "run"


def test_no_suspension_for_a_newcomer_whose_prompt_the_kv_room_cannot_hold() -> None:
    """The newcomer must fit whole beside the suspended request's KV: half-prefilled with no KV
    left, neither it nor the suspended request could go on (a stall the simulation found)."""
    medium = [WaitingItem("m", 500, 0, 0)]  # larger than a whole pass (128)
    for room, suspends in ((499, False), (500, True), (None, True)):
        pol = FairPolicy(params(short_extra_tokens=0, age_weight=1.0, max_partial=2))
        pol.start_long("L", 3000, key=3000.0)
        pol.record_run("L", 128)
        plan = pol.plan(medium, decode_running=False, suspend_room=room)
        assert (plan.yield_to == "partial") is suspends, room
        assert [x.rid for x in pol.suspended] == (["L"] if suspends else [])


def test_a_suspended_request_that_leaves_is_forgotten() -> None:
    pol = FairPolicy(params(short_extra_tokens=0, age_weight=1.0, max_partial=2))
    pol.start_long("L", 3000, key=3000.0)
    pol.record_run("L", 128)
    assert pol.plan([WaitingItem("m", 500, 0, 0)], decode_running=False).yield_to == "partial"
    assert pol.finish_long("L") is not None and pol.suspended == [] and pol.resume() is None


def test_decode_steps_are_spaced_in_prefill_passes_of_any_request() -> None:
    pol = FairPolicy(params(decode_every_chunks=2))
    steps = []
    for running in [1, 1, 1, 1, 0, 0, 1]:
        plan = pol.plan([], decode_running=running > 0, running_reqs=running)
        steps.append("d" if plan.action == "yield" else "p")
        if plan.action != "yield":
            pol.note_prefill()  # a prefill pass (no request is partial: "admit")
    assert "".join(steps) == "ppdpppd"  # passes without decoding requests count too
    assert pol.total_yields_to_decode == 2


def test_decode_share_spaces_steps_by_the_measured_decode_time() -> None:
    pol = FairPolicy(params(decode_share=0.2))
    now = 0.0
    steps = []
    for _ in range(14):
        plan = pol.plan([], decode_running=True, now=now, running_reqs=4)
        if plan.action == "yield":
            steps.append("d")
            now += 0.25  # a decode step takes 0.25 s
        else:
            steps.append("p")
            pol.note_prefill()
            now += 0.25  # prefill passes of 0.25 s
    # share 0.2: 4 decode times (1 s) of prefill between two steps, once the first step was measured.
    assert "".join(steps) == "pdppppdppppdpp"
    assert pol.decode_cost_s == pytest.approx(0.25)


def test_decode_time_share_takes_decode_steps_in_a_row_when_behind() -> None:
    pol = FairPolicy(params(decode_time_share=0.5))
    waiting = [WaitingItem("w", 1000, 0, 0)]
    now, steps = 0.0, []

    def run(n: int, prefill_s: float, decode_s: float, items: list[WaitingItem]) -> None:
        nonlocal now
        for _ in range(n):
            plan = pol.plan(items, decode_running=True, now=now, running_reqs=4)
            if plan.action == "yield" and plan.yield_to == "decode":
                steps.append("d")
                now += decode_s
            else:
                steps.append("p")
                pol.note_prefill()
                now += prefill_s

    # prefill passes of 0.3 s, decode steps of 0.1 s: half the time is 3 decode steps per pass
    run(12, 0.3, 0.1, waiting)
    assert "".join(steps) == "pdddpdddpddd"
    # the last decode step is counted at the next plan
    assert pol.busy_s["decode"] == pytest.approx(0.8) and pol.busy_s["prefill"] == pytest.approx(0.9)
    assert pol.waiting_s == pol.busy_s  # the reported time while prompts waited: the same so far
    # nothing waits: the account restarts, and no decode step is forced
    steps.clear()
    run(2, 0.3, 0.1, [])
    assert "".join(steps) == "pp" and pol.busy_s == {"prefill": 0.0, "decode": 0.0}
    # the reported time is cumulative and takes only passes measured while prompts wait
    assert pol.waiting_s["decode"] == pytest.approx(0.8) and pol.waiting_s["prefill"] == pytest.approx(0.9)
    # decode steps that take no time never catch up: at most TIME_SHARE_MAX_RUN of them in a row
    steps.clear()
    run(40, 0.0, 0.0, waiting)
    assert "".join(steps).startswith("d" * TIME_SHARE_MAX_RUN + "p")
    assert max(len(r) for r in "".join(steps).split("p")) == TIME_SHARE_MAX_RUN
    off = FairPolicy(params())  # decode_time_share 0 (and decode_share 0): no decode step forced
    for t in range(5):
        assert off.plan(waiting, decode_running=True, now=0.3 * t, running_reqs=4).action != "yield"
        off.note_prefill()
    # the time while prompts wait is reported with the option off too (four passes measured)
    assert off.waiting_s["prefill"] == pytest.approx(1.2) and off.waiting_s["decode"] == 0.0


def _overlapped(pol: FairPolicy, n: int, prefill_s: float, decode_s: float) -> str:
    """Plan calls timed as SGLang's overlap scheduler on a GPU times them: pass i is launched and
    pass i-1 awaited, so the next plan call comes when pass i-1 ends."""
    waiting = [WaitingItem("w", 1000, 0, 0)]
    now, prev, steps = 0.0, 0.0, []
    for _ in range(n):
        plan = pol.plan(waiting, decode_running=True, now=now, running_reqs=4)
        if plan.action == "yield" and plan.yield_to == "decode":
            steps.append("d")
            took = decode_s
        else:
            steps.append("p")
            pol.note_prefill()
            took = prefill_s
        now += prev  # this call waited for the previous pass
        prev = took
    return "".join(steps)


@pytest.mark.parametrize("share", [0.5, 0.25, 0.1])
def test_decode_time_share_under_overlap_timing_needs_the_lag(share: float) -> None:
    def decode_time(steps: str) -> float:  # prefill passes of 0.3 s, decode steps of 0.1 s
        return 0.1 * steps.count("d") / (0.1 * steps.count("d") + 0.3 * steps.count("p"))

    lagged = FairPolicy(params(decode_time_share=share))
    lagged.timing_lag = 1
    assert decode_time(_overlapped(lagged, 80, 0.3, 0.1)) == pytest.approx(share, abs=0.03)
    # Read without the lag, the prefill pass that ends during a decode step is charged to that
    # step: the share looks met too soon, and decode gets a third of it or less.
    unlagged = FairPolicy(params(decode_time_share=share))
    assert decode_time(_overlapped(unlagged, 80, 0.3, 0.1)) < 0.4 * share


def test_decode_cost_under_overlap_timing_is_the_decode_steps_own() -> None:
    lagged = FairPolicy(params(decode_share=0.2))
    lagged.timing_lag = 1
    _overlapped(lagged, 20, 0.3, 0.1)
    assert lagged.decode_cost_s == pytest.approx(0.1)
    unlagged = FairPolicy(params(decode_share=0.2))
    _overlapped(unlagged, 20, 0.3, 0.1)
    assert unlagged.decode_cost_s > 0.2  # the prefill passes it waited on


def test_decode_cost_ignores_a_prefill_launch_that_waits_for_its_own_pass() -> None:
    # Overlap timing where launching a prefill pass blocks until that pass ends (a host sync in the
    # launch): the plan call after a decode step then waits for the step and for the next prefill
    # pass, and that interval carries the step's label. Only an interval between two decode
    # passes measures a step alone. Prompts arrive in bursts: 12 passes with prefills, then 3
    # with none (SGLang decodes).
    pol = FairPolicy(params(decode_share=0.2))
    pol.timing_lag = 1
    waiting = [WaitingItem("w", 1000, 0, 0)]
    now, queued = 0.0, 0.0  # queued: device time of the pass launched last, not yet awaited
    for i in range(120):
        busy = i % 20 < 17
        plan = pol.plan(waiting if busy else [], decode_running=True, now=now, running_reqs=4)
        if plan.action == "admit" and busy:
            pol.note_prefill()
            now, queued = now + queued + 0.3, 0.0  # the launch waits for both passes
        else:
            if plan.action != "yield":
                pol.note_decode(now)  # nothing to prefill: SGLang decodes
            now, queued = now + queued, 0.1  # launched; the previous pass is awaited
    assert pol.total_yields_to_decode >= 10
    assert pol.decode_cost_s == pytest.approx(0.1)


def test_rounds_the_scheduler_decodes_without_a_plan_count_as_decode_steps() -> None:
    # SGLang's --prefill-decode-interval 1: after each prefill pass the scheduler decodes once
    # without calling plan. Handed to the policy, those rounds are the decode steps decode_share
    # asks for (it adds none) and time the step; unseen, decode_share adds steps of its own.
    def run(tell: bool) -> FairPolicy:
        pol = FairPolicy(params(decode_share=0.2))
        waiting, now = [WaitingItem("w", 1000, 0, 0)], 0.0
        for _ in range(30):
            plan = pol.plan(waiting, decode_running=True, now=now, running_reqs=4)
            if plan.action == "yield":
                now += 0.05
                continue
            pol.note_prefill()
            now += 0.2  # the prefill pass, then SGLang's deferred decode round
            if tell:
                pol.note_unplanned_decode(now, waiting=True)
            now += 0.05
        return pol

    told, unseen = run(True), run(False)
    assert told.total_yields_to_decode == 0 and told.decode_cost_s == pytest.approx(0.05)
    assert told.waiting_s["decode"] == pytest.approx(29 * 0.05)
    assert unseen.total_yields_to_decode >= 5


def test_quota_growth_sequence_is_capped() -> None:
    p = params(base_quota_tokens=128, quota_growth=2.0, max_quota_tokens=1000)
    assert [p.quota_after(i) for i in range(6)] == [128, 256, 512, 1000, 1000, 1000]
    assert [params(quota_growth=1.0).quota_after(i) for i in range(3)] == [128, 128, 128]


def test_yield_bound_counts_turns_until_work_is_covered() -> None:
    p = params(base_quota_tokens=100, quota_growth=2.0, max_quota_tokens=10_000, max_yields=64)
    # turns 100, 200, 400, 800: cumulative 100, 300, 700, 1500
    assert yield_bound(100, p) == 0
    assert yield_bound(101, p) == 1
    assert yield_bound(1500, p) == 3
    assert yield_bound(1501, p) == 4
    assert yield_bound(10**9, params(max_yields=5)) == 5


@pytest.mark.parametrize("bad", [
    dict(budget_tokens=1), dict(quota_growth=0.9), dict(max_quota_tokens=64), dict(max_yields=-1),
    dict(long_min_share=0.0), dict(long_min_share=1.5), dict(page_size=0), dict(decode_every_chunks=-1),
    dict(short_extra_tokens=-1), dict(age_weight=-1.0), dict(decode_interval_s=-1.0), dict(decode_share=1.0),
    dict(busy_decode_reqs=-1), dict(decode_max_gap_s=-0.5), dict(max_partial=0), dict(decode_time_share=1.0),
    dict(max_long_partial=3, max_partial=2), dict(long_partial_tokens=-1),
])
def test_bad_params_name_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        params(**bad)



# -- properties (simulated engine, adversarial arrivals) ---------------------------------------------

@st.composite
def scenarios(draw: st.DrawFn) -> tuple[QuotaParams, list[list[tuple[str, int]]], list[int]]:
    page = draw(st.sampled_from([1, 4, 16]))
    budget = page * draw(st.integers(2, 16))
    base = draw(st.integers(1, 3 * budget))
    p = QuotaParams(
        budget_tokens=budget,
        base_quota_tokens=base,
        quota_growth=draw(st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0])),
        max_quota_tokens=base + draw(st.integers(0, 4 * budget)),
        max_yields=draw(st.integers(0, 12)),
        long_min_share=draw(st.sampled_from([0.1, 0.25, 0.5, 1.0])),
        decode_every_chunks=draw(st.integers(0, 3)),
        page_size=page,
        short_extra_tokens=draw(st.sampled_from([0, 0, page, budget, 3 * budget])),
        age_weight=draw(st.sampled_from([0.0, 1.0, 8.0, 1e6])),
        decode_interval_s=draw(st.sampled_from([0.0, 0.0, 0.5, 3.0])),
        busy_decode_reqs=draw(st.sampled_from([0, 0, 1, 4])),
        decode_max_gap_s=draw(st.sampled_from([0.0, 0.0, 0.3, 2.0])),
        decode_share=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
        decode_time_share=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6])),
    )
    arrivals: list[list[tuple[str, int]]] = []
    rid = 0
    for _ in range(draw(st.integers(1, 30))):
        batch = []
        for work in draw(st.lists(st.one_of(st.integers(1, budget), st.integers(budget + 1, 8 * budget)), max_size=3)):
            batch.append((f"r{rid}", work))
            rid += 1
        arrivals.append(batch)
    decode = draw(st.lists(st.sampled_from([0, 0, 1, 3, 6]), min_size=1, max_size=7))
    return p, arrivals, decode


def _assert_key_order(reqs: list, p: QuotaParams) -> None:  # type: ignore[type-arg]
    """No request with a larger key started its prefill before a smaller-key one while both waited."""
    key = {r.rid: r.arrival_clock + p.age_weight * r.work_tokens for r in reqs}
    seq = {r.rid: i for i, r in enumerate(reqs)}
    start = {r.rid: (r.active_pass if r.active_pass is not None else r.done_pass) for r in reqs}
    for r in reqs:
        for s in reqs:
            if s is r or (key[s.rid], seq[s.rid]) <= (key[r.rid], seq[r.rid]):
                continue
            # s has the larger key; while both waited, s did not start first.
            if s.arrival_pass <= start[r.rid] and r.arrival_pass <= start[s.rid]:
                assert start[s.rid] >= start[r.rid], (r.rid, s.rid)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.001, 0.05), st.floats(1e-5, 1e-3))
def test_no_starvation_key_order_and_pass_bound(
        scn: tuple[QuotaParams, list[list[tuple[str, int]]], list[int]], base_s: float, per_token_s: float) -> None:
    """On a simulated clock, with adversarial arrivals: every request completes and computes
    exactly its own tokens (nothing recomputed); a partial request completes within
    `pass_bound` passes of its first chunk; and no request with a larger key starts its prefill
    before a waiting request with a smaller one (so a request that arrives after the clock passed
    key(r) never starts before r: the overtake window)."""
    p, arrivals, decode = scn

    def cost(tokens: int, decoding: bool) -> float:
        return base_s + per_token_s * (tokens or p.budget_tokens // 2)

    res = simulate(FairPolicy(p), arrivals, decode, max_passes=20_000, cost=cost)
    assert res.passes < 20_000
    reqs = list(res.requests.values())
    for r in reqs:
        assert r.done_pass is not None, r
        assert r.computed_tokens == r.work_tokens
        assert all(c > 0 for c in r.chunks)
        if r.active_pass is not None:
            assert r.done_pass - r.active_pass + 1 <= pass_bound(r.work_tokens, p, first_chunk=r.chunks[0])
    _assert_key_order(reqs, p)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_quotas_follow_configured_growth(scn: tuple[QuotaParams, list[list[tuple[str, int]]], list[int]]) -> None:
    p, arrivals, decode = scn
    pol = FairPolicy(p)
    simulate(pol, arrivals, decode, max_passes=20_000)
    for done in pol.finished:
        assert done.quotas == [p.quota_after(i) for i in range(len(done.quotas))]
        assert done.yields == len(done.quotas) - 1 <= min(p.max_yields, yield_bound(done.work_tokens, p))
        for prev, nxt in zip(done.quotas, done.quotas[1:]):
            assert nxt == min(p.max_quota_tokens, max(prev + 1, math.ceil(prev * p.quota_growth))) or (
                p.quota_growth == 1.0 and nxt == prev
            )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(2, 4), st.integers(1, 2), st.integers(0, 6))
def test_several_partial_prefills_complete_in_key_order_within_their_caps(
        scn: tuple[QuotaParams, list[list[tuple[str, int]]], list[int]], max_partial: int, max_long: int,
        long_budgets: int) -> None:
    """With suspensions on (adversarial arrivals, simulated engine): every request completes and
    computes exactly its own tokens (a suspended request resumes where it stopped), no larger key
    starts before a waiting smaller one, at most `max_partial` requests are partial at once and at
    most `max_long_partial` of them long."""
    p0, arrivals, decode = scn
    from dataclasses import replace

    p = replace(p0, max_partial=max_partial, max_long_partial=min(max_long, max_partial),
                long_partial_tokens=long_budgets * p0.budget_tokens)
    pol = FairPolicy(p)
    res = simulate(pol, arrivals, decode, max_passes=40_000)
    assert res.passes < 40_000
    assert res.partial_peak <= p.max_partial and res.long_partial_peak <= max(p.max_long_partial, 1)
    reqs = list(res.requests.values())
    for r in reqs:
        assert r.done_pass is not None, r
        assert r.computed_tokens == r.work_tokens
    _assert_key_order(reqs, p)


def test_shorts_that_span_several_chunks_no_longer_wait_for_the_whole_long_prefill() -> None:
    """Issue 27's cause: requests of 1-4 chunks waited behind a long prefill. With riders and the
    key order they are served beside it."""
    p = params(short_extra_tokens=384, age_weight=8.0)
    arrivals: list[list[tuple[str, int]]] = [[("L", 4000)]]
    for i in range(20):  # 129-380 tokens: two or three chunks each
        arrivals += [[(f"s{i}", 129 + (i * 53) % 252)], [], []]
    fair = simulate(FairPolicy(p), arrivals, [0])
    waits = [r.done_pass - r.arrival_pass for r in fair.requests.values() if r.rid != "L"]
    assert max(waits) <= 2  # fcfs: each would wait until pass ~32, when the long prefill ends
    assert fair.requests["L"].done_pass + 1 <= pass_bound(4000, p)


# -- several partial prefills (core/partial.py) --------------------------------------------------------

@st.composite
def candidate_sets(draw: st.DrawFn) -> tuple[PartialParams, list[Candidate]]:
    budget = draw(st.integers(4, 64))
    mp = draw(st.integers(1, 4))
    pp = PartialParams(budget, draw(st.sampled_from([0, budget, 3 * budget])), mp, draw(st.integers(1, mp)),
                       draw(st.sampled_from([0, budget, 2 * budget])), draw(st.sampled_from([0.0, 1.0, 8.0])))
    cands = []
    started = 0
    for i in range(draw(st.integers(0, 10))):
        rem = draw(st.integers(1, 10 * budget))
        is_started = started < mp and draw(st.booleans())
        started += is_started
        cands.append(Candidate(f"c{i}", rem, draw(st.integers(0, 5000)), i, rem, is_started))
    # The long cap holds for the started ones too.
    longs = [c for c in cands if c.started and c.remaining > pp.long_limit]
    for c in longs[pp.max_long_partial:]:
        cands[cands.index(c)] = Candidate(c.rid, c.remaining, c.clock, c.seq, c.work, False)
    return pp, cands


@settings(max_examples=300, deadline=None)
@given(candidate_sets())
def test_plan_pass_respects_budget_caps_and_gives_the_head_a_chunk(scn: tuple[PartialParams, list[Candidate]]) -> None:
    pp, cands = scn
    plan = dict(plan_pass(cands, pp))
    by = {c.rid: c for c in cands}
    assert sum(plan.values()) <= pp.budget_tokens + pp.extra_tokens
    assert all(0 < k <= min(by[r].remaining, pp.budget_tokens) for r, k in plan.items())
    partial_after = [c for c in cands if (c.started and plan.get(c.rid, 0) < c.remaining)
                     or (not c.started and 0 < plan.get(c.rid, 0) < c.remaining)]
    assert len(partial_after) <= pp.max_partial
    assert sum(1 for c in partial_after if c.remaining > pp.long_limit) <= pp.max_long_partial
    order = sorted(cands, key=lambda c: candidate_key(c, pp.age_weight))
    for c in order:  # the first one allowed to run gets a whole chunk (or finishes)
        if c.rid in plan:
            assert plan[c.rid] == min(c.remaining, pp.budget_tokens)
            break
        # skipped only when it would need a partial slot and none is free
        assert not c.started and c.remaining > pp.budget_tokens


def test_several_partial_prefills_let_a_short_pass_a_huge_prompt() -> None:
    pp = PartialParams(budget_tokens=128, extra_tokens=0, max_partial=2, max_long_partial=1, age_weight=8.0)
    huge = Candidate("huge", 100_000, 0, 0, 100_000, True)
    short = Candidate("s", 300, 100, 1, 300)  # 3 chunks: needs a partial slot of its own
    assert plan_pass([huge, short], pp) == [("s", 128)]  # smaller key: it runs, the huge one waits a pass
    one_slot = PartialParams(budget_tokens=128, max_partial=1, max_long_partial=1, age_weight=8.0)
    assert plan_pass([huge, short], one_slot) == [("huge", 128)]  # SGLang's single slot: it waits


def test_decode_cost_is_not_inflated_by_an_idle_interval() -> None:
    # Decode steps of 0.01 s; once, the scheduler idled 2 s between a decode step and the next
    # plan call (nothing to run), and that interval reads as one decode step.
    pol = FairPolicy(params(decode_share=0.2))
    now, steps, seen = 0.0, 0, []
    for _ in range(60):
        plan = pol.plan([], decode_running=True, now=now, running_reqs=4)
        if pol.decode_cost_s is not None:
            seen.append(pol.decode_cost_s)
        if plan.action == "yield":
            steps += 1
            now += 2.0 if steps == 3 else 0.01
        else:
            pol.note_prefill()
            now += 0.05
    assert steps >= 6 and max(seen) < 2.0  # the idle interval was read as a step once ...
    assert pol.decode_cost_s == pytest.approx(0.01)  # ... and does not set the estimate
