"""Unit and property tests of the fair_sched policy core (no SGLang)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.fair_sched.core.quota import (
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
from kllm_plugins.plugins.fair_sched.core.simulate import simulate


def params(**kw: object) -> QuotaParams:
    base: dict[str, object] = dict(
        budget_tokens=128, base_quota_tokens=128, quota_growth=1.5, max_quota_tokens=512,
        max_yields=64, long_min_share=0.25, decode_every_chunks=0,
    )
    base.update(kw)
    return QuotaParams(**base)  # type: ignore[arg-type]


def test_order_puts_one_chunk_requests_first_in_arrival_order() -> None:
    pol = FairPolicy(params())
    pol.start_long("active", 1000)
    waiting = [WaitingItem("L1", 900, 1), WaitingItem("s2", 60, 2), WaitingItem("L3", 400, 3), WaitingItem("s0", 128, 0)]
    assert [waiting[i].rid for i in pol.order(waiting)] == ["s0", "s2", "L1", "L3"]


def test_order_starts_oldest_long_beside_the_shorts_that_fit_its_minimum_share() -> None:
    pol = FairPolicy(params())  # min share 32 tokens: shorts may take 96
    waiting = [WaitingItem("L1", 900, 1), WaitingItem("s2", 60, 2), WaitingItem("s3", 30, 3),
               WaitingItem("s4", 10, 4), WaitingItem("L5", 500, 5)]
    order = [waiting[i].rid for i in pol.order(waiting)]
    # s2 + s3 = 90 fit in 96; s4 would not fit after them, so the long goes before it.
    assert order == ["s2", "s3", "L1", "s4", "L5"]


def test_plan_reserves_budget_for_waiting_shorts_and_caps_the_long_chunk() -> None:
    pol = FairPolicy(params(page_size=16))
    pol.start_long("L", 2000)
    plan = pol.plan([WaitingItem("a", 20, 0), WaitingItem("b", 40, 1), WaitingItem("c", 50, 2)], decode_running=False)
    # ceil-paged charges 32 + 48 = 80 fit in 128 - 32; c (64) would exceed it.
    assert plan.action == "run"
    assert plan.reserved_tokens == 80
    assert plan.long_limit == 48
    assert pol.plan([], decode_running=False).long_limit is None


def test_long_yields_to_blocked_shorts_only_after_its_quota() -> None:
    pol = FairPolicy(params())
    pol.start_long("L", 3000)
    big = [WaitingItem("s", 120, 0)]  # cannot share: 120 > 128 - 32
    pol.record_run("L", 64)
    assert pol.plan(big, decode_running=False).action == "run"  # 64 < quota 128
    pol.record_run("L", 64)
    plan = pol.plan(big, decode_running=False)
    assert (plan.action, plan.yield_to) == ("yield", "short")
    assert pol.active is not None and pol.active.quota == 192 and pol.active.turn_used == 0


def test_decode_yield_every_k_chunks_leaves_quota_alone() -> None:
    pol = FairPolicy(params(decode_every_chunks=2))
    pol.start_long("L", 3000)
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=True).action == "run"
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=False).action == "run"  # nobody decodes: no yield
    plan = pol.plan([], decode_running=True)
    assert (plan.action, plan.yield_to) == ("yield", "decode")
    assert pol.active is not None and pol.active.quota == 128 and pol.active.yields == 0


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


def test_riding_shorts_leave_the_long_chunk_whole() -> None:
    pol = FairPolicy(params(short_extra_tokens=128, page_size=16))
    pol.start_long("L", 3000)
    plan = pol.plan([WaitingItem("a", 20, 0), WaitingItem("b", 90, 1)], decode_running=False)
    # ceil-paged 32 + 96 = 128 ride on top of the budget; the long chunk keeps all 128 tokens.
    assert (plan.action, plan.long_limit, plan.reserved_tokens, plan.extra_tokens) == ("run", 128, 128, 128)
    assert pol.plan([], decode_running=False) == PassPlan("run")
    # What does not fit in the extra tokens blocks; the long request yields only after its quota.
    crowd = [WaitingItem("a", 100, 0), WaitingItem("b", 100, 1)]
    assert pol.plan(crowd, decode_running=False).extra_tokens == 112
    pol.record_run("L", 128)
    assert (pol.plan(crowd, decode_running=False).yield_to) == "short"
    # The stated bound counts full-budget running passes and the larger pass.
    p = pol.params
    assert pass_bound(1280, p) == 10 + yield_bound(1280, p)
    assert stretch_bound(1280, p) == pytest.approx(pass_bound(1280, p) / 10 * 2.0)


def test_waiting_longs_go_shortest_first_within_the_overtake_cap() -> None:
    pol = FairPolicy(params(long_overtake_max=2))
    queue = [WaitingItem("old", 4000, 0), WaitingItem("mid", 3000, 1), WaitingItem("s", 50, 2),
             WaitingItem("new1", 2000, 3), WaitingItem("new2", 2500, 4)]

    def start_next(q: list[WaitingItem]) -> str:
        order = [q[i].rid for i in pol.order(q)]
        nxt = next(r for r in order if r != "s")
        pol.start_long(nxt, 1000)
        pol.finish_long(nxt)
        q[:] = [w for w in q if w.rid != nxt]
        return nxt

    q = list(queue)
    assert start_next(q) == "new1"  # shortest; overtakes old and mid
    assert pol.overtaken == {"old": 1, "mid": 1}
    assert start_next(q) == "new2"  # overtakes them again: both now at the cap
    assert start_next(q) == "old"  # capped: the oldest goes next, shorter "mid" or not
    assert start_next(q) == "mid"
    assert pol.total_overtakes == 4
    # With the cap at 0 (the stock order) the oldest always goes first.
    fcfs = FairPolicy(params())
    assert [queue[i].rid for i in fcfs.order(queue)][:2] == ["s", "old"]


def test_next_long_leads_the_queue_while_one_is_active() -> None:
    """SGLang frees the chunked slot inside the pass that runs the active request's last chunk and
    truncates the first waiting long request into the rest of it: the order must already put the
    chosen one first then (the recorded run of 11:35 missed this and never overtook)."""
    pol = FairPolicy(params(long_overtake_max=2))
    pol.start_long("A", 1000)
    queue = [WaitingItem("old", 4000, 0), WaitingItem("s", 50, 1), WaitingItem("short-long", 2000, 2)]
    assert [queue[i].rid for i in pol.order(queue)] == ["s", "short-long", "old"]
    # In the pass model: A's last chunk (10 tokens) leaves room, and the shorter long request
    # starts in that same pass, ahead of the older one.
    arrivals: list[list[tuple[str, int]]] = [[("A", 138)], [("old", 4000), ("short-long", 2000)]]
    res = simulate(FairPolicy(params(long_overtake_max=2)), arrivals, [False])
    assert res.requests["A"].done_pass == res.requests["short-long"].active_pass == 1
    assert res.requests["old"].active_pass >= res.requests["short-long"].done_pass  # in its last pass at the earliest


def test_decode_interval_spaces_decode_steps_on_a_simulated_clock() -> None:
    pol = FairPolicy(params(decode_every_chunks=1, decode_interval_s=0.5))
    pol.start_long("L", 3000)
    pol.note_decode(0.0)
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=True, now=0.3).action == "run"  # last decode only 0.3 s ago
    pol.record_run("L", 128)
    plan = pol.plan([], decode_running=True, now=0.6)
    assert (plan.action, plan.yield_to, pol.last_decode_s) == ("yield", "decode", 0.6)
    # Right after a decode step: at least one chunk first, whatever the clock says.
    assert pol.plan([], decode_running=True, now=5.0).action == "run"
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=False, now=9.0).action == "run"  # nobody decodes
    pol.note_decode(9.0)  # a decode pass the scheduler ran on its own
    assert pol.plan([], decode_running=True, now=9.2).action == "run"
    assert pol.params.decode_spacing_chunks == 1


def test_busy_decode_steps_come_after_every_chunk_while_many_requests_decode() -> None:
    pol = FairPolicy(params(decode_every_chunks=3, busy_decode_reqs=8))
    pol.start_long("L", 4000)
    steps: list[str] = []
    # Few requests decode: a decode step after every third chunk; many: after every chunk.
    for running in [2, 2, 2, 2, 2, 2, 2, 2, 9, 9, 9, 9, 20, 20, 1, 1, 1, 1]:
        plan = pol.plan([], decode_running=running > 0, running_reqs=running)
        steps.append("d" if plan.action == "yield" else "c")
        if plan.action == "run":
            pol.record_run("L", 128)
    assert "".join(steps) == "cccdcccdcdcdcdcccd"
    assert pol.active is not None and pol.active.decode_passes == 6
    # Without a running count (older callers) the chunk count alone decides.
    other = FairPolicy(params(decode_every_chunks=3, busy_decode_reqs=8))
    other.start_long("L", 4000)
    other.record_run("L", 128)
    assert other.plan([], decode_running=True).action == "run"
    # The bound assumes the worst case: a decode step after every chunk.
    assert params(decode_every_chunks=3, busy_decode_reqs=8).decode_spacing_chunks == 1
    ride = params(decode_every_chunks=3, short_extra_tokens=128)
    busy = params(decode_every_chunks=3, short_extra_tokens=128, busy_decode_reqs=8)
    # 10 running passes of 128 tokens: ceil(10 / 3) = 4 decode steps, or 10 when busy.
    assert pass_bound(1280, busy) - pass_bound(1280, ride) == 10 - 4


def test_busy_decode_overrides_the_clock_spacing() -> None:
    pol = FairPolicy(params(decode_every_chunks=1, decode_interval_s=1.0, busy_decode_reqs=4))
    pol.start_long("L", 4000)
    pol.note_decode(0.0)
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=True, now=0.2, running_reqs=3).action == "run"  # clock: 0.2 s < 1 s
    pol.record_run("L", 128)
    plan = pol.plan([], decode_running=True, now=0.4, running_reqs=4)
    assert (plan.action, plan.yield_to) == ("yield", "decode")


def test_decode_max_gap_brings_a_decode_step_once_the_last_one_is_that_old() -> None:
    pol = FairPolicy(params(decode_every_chunks=3, decode_max_gap_s=0.5))
    pol.start_long("L", 6000)
    pol.note_decode(0.0)
    # Chunks of 0.3 s: the chunk count (3) would wait 0.9 s; the gap (0.5 s) brings the step after 2.
    steps: list[str] = []
    now = 0.0
    for _ in range(9):
        plan = pol.plan([], decode_running=True, now=now, running_reqs=2)
        if plan.action == "yield":
            steps.append("d")
            now += 0.01
        else:
            steps.append("c")
            pol.record_run("L", 128)
            now += 0.3
    assert "".join(steps) == "ccdccdccd"
    # Never two decode steps in a row: a chunk comes first, however old the last decode is.
    assert pol.plan([], decode_running=True, now=100.0, running_reqs=2).action == "run"
    # Nobody decoding: no step.
    pol.record_run("L", 128)
    assert pol.plan([], decode_running=False, now=200.0, running_reqs=0).action == "run"
    assert params(decode_every_chunks=3, decode_max_gap_s=0.5).decode_spacing_chunks == 1


@pytest.mark.parametrize("bad", [
    dict(budget_tokens=1), dict(quota_growth=0.9), dict(max_quota_tokens=64), dict(max_yields=-1),
    dict(long_min_share=0.0), dict(long_min_share=1.5), dict(page_size=0), dict(decode_every_chunks=-1),
    dict(short_extra_tokens=-1), dict(long_overtake_max=-1), dict(decode_interval_s=-1.0),
    dict(busy_decode_reqs=-1), dict(decode_max_gap_s=-0.5),
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
        short_extra_tokens=draw(st.sampled_from([0, 0, page, budget, 2 * budget])),
        long_overtake_max=draw(st.sampled_from([0, 0, 1, 2, 3])),
        decode_interval_s=draw(st.sampled_from([0.0, 0.0, 0.5, 3.0])),
        busy_decode_reqs=draw(st.sampled_from([0, 0, 1, 4])),
        decode_max_gap_s=draw(st.sampled_from([0.0, 0.0, 0.3, 2.0])),
    )
    n_passes = draw(st.integers(1, 30))
    arrivals: list[list[tuple[str, int]]] = []
    rid = 0
    for _ in range(n_passes):
        batch = []
        # Adversarial: a stream of one-chunk requests, some just too big to share, some longs.
        for work in draw(st.lists(st.one_of(st.integers(1, budget), st.integers(budget + 1, 8 * budget)), max_size=3)):
            batch.append((f"r{rid}", work))
            rid += 1
        arrivals.append(batch)
    # How many requests decode in each pass (0: none), cycled over the passes.
    decode = draw(st.lists(st.sampled_from([0, 0, 1, 3, 6]), min_size=1, max_size=7))
    return p, arrivals, decode


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_starvation_and_no_recompute(scn: tuple[QuotaParams, list[list[tuple[str, int]]], list[int]]) -> None:
    p, arrivals, decode = scn
    pol = FairPolicy(p)
    res = simulate(pol, arrivals, decode, max_passes=20_000)
    assert res.passes < 20_000
    active_spans = {}
    for r in res.requests.values():
        # Every request completes, and computes exactly its own tokens: a resumed long request
        # continues from its offset (nothing recomputed, nothing skipped).
        assert r.done_pass is not None, r
        assert r.computed_tokens == r.work_tokens
        assert all(c > 0 for c in r.chunks)
        if r.active_pass is not None:
            active_spans[r.rid] = (r.active_pass, r.done_pass)
            # Stated starvation bound, in passes, after its first chunk (which may have been cut
            # short when it was admitted as a one-chunk request into a partly used pass).
            assert r.done_pass - r.active_pass + 1 <= pass_bound(r.work_tokens, p, first_chunk=r.chunks[0])
    seq = {rid: i for i, rid in enumerate(res.requests)}
    for r in res.requests.values():
        start = r.active_pass if r.active_pass is not None else r.done_pass
        assert start is not None
        if r.work_tokens > p.budget_tokens:
            # Overtaken by at most long_overtake_max younger long requests.
            overtakers = [o for o in res.requests.values() if seq[o.rid] > seq[r.rid] and o.work_tokens > p.budget_tokens
                          and o.active_pass is not None and r.arrival_pass <= o.active_pass < start]
            assert len(overtakers) <= p.long_overtake_max, (r.rid, [o.rid for o in overtakers])
        for k in range(r.arrival_pass, start):
            if r.work_tokens > p.budget_tokens:
                # A long request waits only behind requests that are long or hold the single
                # chunked slot: older ones, or (within the overtake cap) the younger one that
                # holds the slot; never behind a stream of one-chunk requests.
                assert any(
                    (seq[o.rid] < seq[r.rid] or (o.active_pass is not None and o.active_pass <= k))
                    and (o.work_tokens > p.budget_tokens or o.rid in active_spans)
                    and o.done_pass is not None and o.done_pass >= k
                    for o in res.requests.values()
                ), (r.rid, k)
            else:
                # A one-chunk request waits only while the pass went to the long request's decode
                # yield, or to requests that arrived before it or hold the chunked slot.
                ran = res.prefilled[k]
                assert not ran or any(seq[o] < seq[r.rid] or o in active_spans for o in ran), (r.rid, k)


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


def test_fair_policy_cuts_short_waits_behind_a_long_prefill() -> None:
    """Against first-come-first-served in the same model, shorts arriving during a long prefill wait less."""
    p = params(decode_every_chunks=2)
    arrivals: list[list[tuple[str, int]]] = [[("L", 4000)]]
    for i in range(30):  # one short every third pass, 40-119 tokens (some cannot share the pass)
        arrivals += [[(f"s{i}", 40 + (i * 37) % 80)], [], []]
    fair = simulate(FairPolicy(p), arrivals, [True])
    fcfs_wait = 4000 // 128  # under FCFS each short waits at least until the long prefill ends
    waits = [r.done_pass - r.arrival_pass for r in fair.requests.values() if r.rid != "L"]
    assert max(waits) < fcfs_wait / 3
    long_passes = fair.requests["L"].done_pass + 1
    assert long_passes <= pass_bound(4000, p)


# -- starvation bound on a simulated clock ------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.001, 0.05), st.floats(1e-5, 1e-3), st.floats(0.02, 1.0))
def test_long_requests_finish_within_k_times_solo_latency(
    scn: tuple[QuotaParams, list[list[tuple[str, int]]], list[int]], base_s: float, per_token_s: float, decode_frac: float
) -> None:
    """Stated bound: a long request finishes within K x the solo latency of itself and the long
    requests served before it since its arrival (the older ones still unfinished, and at most
    long_overtake_max younger ones), plus two of the largest passes each (arrival mid-pass, a
    short first chunk). K = max stretch_bound(W). Pass costs: prefill base + per token (riding
    passes prefill up to max_pass_tokens), a decode step at most one full-budget pass;
    adversarial arrivals."""
    p, arrivals, decode = scn
    full_s = base_s + per_token_s * p.budget_tokens
    max_pass_s = base_s + per_token_s * p.max_pass_tokens

    def cost(tokens: int, decoding: bool) -> float:
        return base_s + per_token_s * tokens if tokens or not decoding else decode_frac * full_s

    res = simulate(FairPolicy(p), arrivals, decode, max_passes=20_000, cost=cost)
    reqs = list(res.requests.values())
    seq = {r.rid: i for i, r in enumerate(reqs)}
    holds_slot = {r.rid for r in reqs if r.active_pass is not None}
    for r in reqs:
        if r.work_tokens <= p.budget_tokens:
            continue  # one-chunk requests: see test_no_starvation_and_no_recompute
        assert r.done_pass is not None
        start = r.active_pass if r.active_pass is not None else r.done_pass
        ahead = [o for o in reqs if seq[o.rid] < seq[r.rid] and (o.rid in holds_slot or o.work_tokens > p.budget_tokens)
                 and o.done_pass is not None and o.done_pass >= r.arrival_pass]
        overtakers = [o for o in reqs if seq[o.rid] > seq[r.rid] and o.rid in holds_slot and o.active_pass is not None
                      and r.arrival_pass <= o.active_pass <= start and o is not r]
        chain = ahead + overtakers + [r]
        k = max(stretch_bound(o.work_tokens, p) for o in chain)
        solo_s = sum(solo_passes(o.work_tokens, p) * full_s for o in chain)
        elapsed = res.pass_end_s[r.done_pass] - res.start_s(r.arrival_pass)
        assert elapsed <= k * solo_s + 2 * len(chain) * max_pass_s + 1e-9, (r.rid, elapsed, k, solo_s)


def test_stretch_bound_of_the_defaults_for_the_issue_mix() -> None:
    from kllm_plugins.plugins.fair_sched.config import FairSchedConfig

    p = FairSchedConfig().quota_params(128)
    k = max_stretch_bound(2500, 5000, p)
    assert all(k >= stretch_bound(w, p) for w in (2500, 2501, 3000, 4999, 5000))
    assert 1.0 < k < 8.0
    # A solo request (nothing else arriving, nobody decoding) takes exactly its solo passes.
    res = simulate(FairPolicy(p), [[("L", 4000)]], [False])
    assert res.requests["L"].done_pass + 1 == solo_passes(4000, p)


def test_plan_and_order_use_the_pass_budget_left_by_decode_rows() -> None:
    pol = FairPolicy(params())
    pol.start_long("L", 3000)
    waiting = [WaitingItem("a", 40, 0), WaitingItem("b", 40, 1)]
    # Full budget: room 96 holds both; with 20 decode rows riding along, room 76 holds only "a".
    assert pol.plan(waiting, decode_running=True).reserved_tokens == 80
    plan = pol.plan(waiting, decode_running=True, budget=108)
    assert (plan.action, plan.reserved_tokens, plan.long_limit) == ("run", 40, 68)
    # Nothing is reserved out of a budget smaller than the long request's minimum share.
    tight = pol.plan(waiting, decode_running=True, budget=10)
    assert (tight.action, tight.reserved_tokens, tight.long_limit) == ("run", 0, None)
    fresh = FairPolicy(params())
    queue = [WaitingItem("s1", 50, 0), WaitingItem("L", 900, 1), WaitingItem("s2", 40, 2)]
    assert [queue[i].rid for i in fresh.order(queue)] == ["s1", "s2", "L"]
    assert [queue[i].rid for i in fresh.order(queue, budget=100)] == ["s1", "L", "s2"]
