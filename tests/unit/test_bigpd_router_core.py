"""Unit tests (no SGLang): registry, SLO Load, prefix tree, pairing, scaling controller."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.pairing import NoInstance, Picker
from kllm_plugins.plugins.bigpd_router.core.prefix_tree import PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.scaling import PoolDecider, ScalePolicy, ScalingController
from kllm_plugins.plugins.bigpd_router.core.slo_load import (
    PoolLoad,
    RateEstimator,
    TokenEstimator,
    WindowStat,
    batch_factor,
    decode_pool_load,
    observe_tpot,
    prefill_pool_load,
    tpot_pred,
    ttft_pred,
)

sys.path.insert(0, str(Path(__file__).parent))
from bigpd_router_fixtures import Clock, healthy  # noqa: E402


# ---------------------------------------------------------------- config
def test_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="ttft_target_s"):
        RouterConfig(ttft_target_s=0)
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="scale_down_load"):
        RouterConfig(scale_down_load=1.0, scale_up_load=0.9)
    with pytest.raises(ValueError, match="max_instances"):
        RouterConfig(min_instances=3, max_instances=2)


# ---------------------------------------------------------------- registry
def test_registry_join_drain_remove_and_health_transitions() -> None:
    reg = Registry(health_failures=2)
    events: list[tuple[str, str]] = []
    reg.subscribe(lambda ev, inst: events.append((ev, inst.url)))
    reg.add(Instance(url="http://a:1", role=Role.PREFILL))
    reg.add(Instance(url="http://b:1", role=Role.DECODE))
    with pytest.raises(ValueError):
        reg.add(Instance(url="http://a:1", role=Role.PREFILL))
    a = reg.get("http://a:1")
    assert a is not None and not a.routable  # starting until its first good check
    reg.mark_check("http://a:1", False)
    assert a.health is Health.STARTING  # a failing start-up is not "unhealthy" yet
    reg.mark_check("http://a:1", True)
    assert a.routable and reg.pool(Role.PREFILL, routable_only=True) == [a]
    reg.mark_check("http://a:1", False)
    assert a.routable  # one miss is tolerated
    reg.mark_check("http://a:1", False)
    assert a.health is Health.UNHEALTHY and reg.pool(Role.PREFILL, routable_only=True) == []
    reg.mark_check("http://a:1", True)
    assert a.routable
    reg.start_drain("http://a:1")
    assert not a.routable and reg.pool(Role.PREFILL) == []
    assert reg.pool(Role.PREFILL, include_draining=True) == [a]
    reg.mark_check("http://a:1", True)
    assert a.health is Health.DRAINING  # health checks do not undo a drain
    reg.remove("http://a:1")
    assert "http://a:1" not in reg and len(reg) == 1
    assert ("join", "http://a:1") in events and ("remove", "http://a:1") in events


# ---------------------------------------------------------------- SLO load
def test_rate_estimator_and_window() -> None:
    r = RateEstimator(initial=10.0, alpha=0.5)
    assert r.update(20.0) == 20.0  # first sample replaces the prior
    assert r.update(10.0) == 15.0
    assert r.update(float("nan")) == 15.0
    clock = Clock()
    w = WindowStat(window_s=10.0, clock=clock)
    w.add(1.0)
    clock.t += 5
    w.add(3.0)
    assert w.mean() == 2.0 and w.quantile(0.99) == 3.0
    clock.t += 6
    assert w.values() == [3.0]
    clock.t += 20
    assert w.mean() == 0.0 and len(w) == 0


def test_ttft_prediction_uses_backlog_and_rate() -> None:
    inst = healthy("http://a:1")
    inst.prefill_rate.update(1000.0)
    assert ttft_pred(inst, 500) == pytest.approx(0.5)
    inst.pending_prefill_tokens = 1500
    assert ttft_pred(inst, 500) == pytest.approx(2.0)
    inst.reported.waiting_tokens = 3500  # the instance knows of more than we routed
    assert ttft_pred(inst, 500) == pytest.approx(4.0)


def test_load_is_max_of_pred_and_actual_over_target() -> None:
    clock = Clock()
    actual = WindowStat(clock=clock)
    a, b = healthy("http://a:1", Role.PREFILL), healthy("http://b:1", Role.PREFILL)
    for inst in (a, b):
        inst.prefill_rate.update(1000.0)
    a.pending_prefill_tokens = 2000
    load = prefill_pool_load([a, b], actual, target_s=1.0, typical_prompt_tokens=1000)
    assert load.pred == pytest.approx((3.0 + 1.0) / 2)
    assert load.load == pytest.approx(2.0)
    actual.add(5.0)
    load = prefill_pool_load([a, b], actual, target_s=1.0, typical_prompt_tokens=1000)
    assert load.load == pytest.approx(5.0)
    # floor = a lone typical request's TTFT (1 s); only the 4 s above it is shared out over instances
    assert load.floor == pytest.approx(1.0)
    assert load.load_with(1) == pytest.approx(1.0 + 4.0 * 2) and math.isinf(load.load_with(0))
    assert load.load_with(4) == pytest.approx(1.0 + 4.0 / 2)
    assert load.load_with(4, pred_only=True) == pytest.approx(1.0 + 1.0 / 2)


def test_decode_load_grows_with_batch() -> None:
    d = healthy("http://d:1", Role.DECODE)
    observe_tpot(d, 0.05 * batch_factor(4), batch=4)
    assert d.tpot.value == pytest.approx(0.05)  # normalised to a single request
    assert tpot_pred(d, extra=0) == pytest.approx(0.05)  # idle
    d.decoding = 4
    assert tpot_pred(d) == pytest.approx(0.05 * batch_factor(5))
    d.decoding = 8
    assert tpot_pred(d) > 0.05 * batch_factor(5)
    d.decoding = 4
    idle = healthy("http://e:1", Role.DECODE)
    idle.tpot.update(0.05)
    load = decode_pool_load([d, idle], WindowStat(), target_s=0.05)
    assert load.load == pytest.approx(batch_factor(5) / 2)


def test_token_estimator_learns_ratio() -> None:
    est = TokenEstimator(chars_per_token=4.0)
    assert est.estimate(400) == 100
    for _ in range(100):
        est.observe(800, 100)
    assert est.estimate(800) == pytest.approx(100, rel=0.05)


# ---------------------------------------------------------------- prefix tree
def test_prefix_tree_matches_longest_shared_prefix_per_instance() -> None:
    t = PrefixTree(block=4)
    t.insert("aaaabbbbcccc", "A")
    t.insert("aaaabbbbdddd", "B")
    assert t.match("aaaabbbbcccceeee") == {"A": 3, "B": 2}
    assert t.match("aaaaxxxx") == {"A": 1, "B": 1}
    assert t.match("zzzz") == {}
    assert t.match("aaa") == {}  # partial block is no prefix
    t.forget("A")
    assert t.match("aaaabbbbcccc") == {"B": 2}


def test_prefix_tree_token_ids() -> None:
    t = PrefixTree(block=8)  # 2 token ids per block
    t.insert([1, 2, 3, 4, 5, 6], "A")
    assert t.match([1, 2, 3, 4, 9, 9]) == {"A": 2}


def test_prefix_tree_evicts_leaves_first() -> None:
    t = PrefixTree(block=1, max_blocks=6)
    t.insert("abcd", "A")
    t.insert("xyz", "B")  # 7 blocks: the oldest leaf (d of A) goes
    assert len(t) == 6
    assert t.match("abcd") == {"A": 3}
    assert t.match("xyz") == {"B": 3}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("ABC"), st.text(alphabet="ab", min_size=0, max_size=12)),
                    max_size=30),
       probe=st.text(alphabet="ab", max_size=12))
def test_prefix_tree_agrees_with_brute_force(ops: list[tuple[str, str]], probe: str) -> None:
    """Without eviction, match() equals the longest common whole-block prefix per instance."""
    t = PrefixTree(block=2, max_blocks=10_000)
    sent: dict[str, list[str]] = {}
    for url, prompt in ops:
        t.insert(prompt, url)
        sent.setdefault(url, []).append(prompt)
    expect = {}
    for url, prompts in sent.items():
        best = 0
        for p in prompts:
            n = 0
            while (n + 1) * 2 <= min(len(p), len(probe)) and p[: (n + 1) * 2] == probe[: (n + 1) * 2]:
                n += 1
            best = max(best, n)
        if best:
            expect[url] = best
    assert t.match(probe) == expect


# ---------------------------------------------------------------- pairing
def make_picker(policy: str = "slo_affinity") -> Picker:
    return Picker(policy, PrefixTree(block=8), ttft_target_s=1.0, tpot_target_s=0.1)


def test_affinity_wins_when_loads_are_close_and_loses_when_far() -> None:
    p = make_picker()
    a, b = healthy("http://a:1"), healthy("http://b:1")
    for i in (a, b):
        i.prefill_rate.update(1000.0)
    prompt = "S" * 800 + "q1"
    p.routed(prompt, b)
    assert p.pick_prefill([a, b], prompt, 200).instance is b
    b.pending_prefill_tokens = 100  # a little busier: the cache is still worth it
    choice = p.pick_prefill([a, b], prompt, 200)
    assert choice.instance is b and choice.cached_fraction == 100 / 100  # 800 chars / 8 per block, all sent to b
    b.pending_prefill_tokens = 5000  # much busier: load wins
    assert p.pick_prefill([a, b], prompt, 200).instance is a


def test_pick_excludes_and_skips_unroutable_with_panic_fallback() -> None:
    p = make_picker("least_load")
    a, b = healthy("http://a:1"), healthy("http://b:1")
    b.health = Health.UNHEALTHY
    assert p.pick_prefill([a, b], "x", 1).instance is a
    # every healthy one excluded: fall back to the unhealthy one rather than refuse
    assert p.pick_prefill([a, b], "x", 1, exclude=frozenset({"http://a:1"})).instance is b
    with pytest.raises(NoInstance):
        p.pick_prefill([a, b], "x", 1, exclude=frozenset({"http://a:1", "http://b:1"}))
    a.health = Health.DRAINING
    b.health = Health.STARTING
    with pytest.raises(NoInstance):  # draining and starting ones are never used
        p.pick_prefill([a, b], "x", 1)


def test_round_robin_cycles() -> None:
    p = make_picker("round_robin")
    insts = [healthy(f"http://h{i}:1") for i in range(3)]
    seen = [p.pick_prefill(insts, "x" * 64, 16).instance.url for _ in range(6)]
    assert sorted(set(seen)) == sorted(i.url for i in insts) and seen[:3] == seen[3:]


def test_decode_pick_prefers_free_kv_and_low_batch() -> None:
    p = make_picker()
    d1, d2 = healthy("http://d1:1", Role.DECODE), healthy("http://d2:1", Role.DECODE)
    d1.decoding, d2.decoding = 8, 2
    assert p.pick_decode([d1, d2], None) is d2
    d2.reported.token_usage, d2.reported.at = 0.97, 1.0
    assert p.pick_decode([d1, d2], None) is d1
    with pytest.raises(NoInstance):
        p.pick_decode([], None)


# ---------------------------------------------------------------- scaling
POLICY = ScalePolicy(up_load=0.9, down_load=0.4, up_sustain_s=10, down_sustain_s=30, cooldown_s=20,
                     min_instances=1, max_instances=3, drain_timeout_s=60)


def pl(load: float, n: int) -> PoolLoad:
    return PoolLoad(pred=load, actual=0.0, target=1.0, instances=n)


def test_decider_needs_sustained_load_and_respects_cooldown() -> None:
    d = PoolDecider(Role.PREFILL, POLICY)
    assert d.decide(pl(2.0, 1), 1, 0).action == "hold"
    assert d.decide(pl(2.0, 1), 1, 5).action == "hold"
    assert d.decide(pl(0.5, 1), 1, 8).action == "hold"  # dip resets the sustain timer
    assert d.decide(pl(2.0, 1), 1, 9).action == "hold"
    assert d.decide(pl(2.0, 1), 1, 19).action == "up"
    assert d.decide(pl(2.0, 2), 2, 30).action == "hold"  # cool-down
    assert d.decide(pl(2.0, 2), 2, 39).action == "hold"
    assert d.decide(pl(2.0, 2), 2, 49).action == "up"
    assert d.decide(pl(2.0, 3), 3, 80).action == "hold"
    assert "maximum" in d.decide(pl(2.0, 3), 3, 100).reason


def test_urgent_predicted_load_skips_the_sustain_but_not_the_cooldown() -> None:
    import dataclasses

    d = PoolDecider(Role.PREFILL, dataclasses.replace(POLICY, urgent_load=2.5))
    assert d.decide(pl(2.0, 1), 1, 0).action == "hold"  # high, not urgent: waits for the sustain
    dec = d.decide(pl(3.0, 1), 1, 1)  # a predicted backlog this large is not noise
    assert dec.action == "up" and "urgent" in dec.reason
    assert d.decide(pl(3.0, 2), 2, 2).action == "hold"  # cool-down still holds
    # a measured (actual) spike alone is not urgent: only the prediction counts
    d2 = PoolDecider(Role.PREFILL, dataclasses.replace(POLICY, urgent_load=2.5))
    assert d2.decide(PoolLoad(pred=0.5, actual=3.0, target=1.0, instances=1), 1, 0).action == "hold"
    with pytest.raises(ValueError, match="urgent_load"):
        dataclasses.replace(POLICY, urgent_load=0.5)


def test_decider_scales_down_only_if_load_after_removal_is_low() -> None:
    d = PoolDecider(Role.DECODE, POLICY)
    # load 0.3 with 2 instances would be 0.6 with one: not low enough
    for t in range(0, 100, 5):
        assert d.decide(pl(0.3, 2), 2, t).action == "hold"
    d2 = PoolDecider(Role.DECODE, POLICY)
    acts = [d2.decide(pl(0.1, 2), 2, t).action for t in range(0, 40, 5)]
    assert acts.count("down") == 1 and acts.index("down") == 6  # at t=30
    assert d2.decide(pl(0.0, 1), 1, 1000).action == "hold"  # minimum


def test_decider_sizes_the_step_on_predicted_load() -> None:
    d = PoolDecider(Role.PREFILL, ScalePolicy(up_sustain_s=0, cooldown_s=0, max_instances=8))
    # predicted load 3.0 on 2 instances, no floor: 7 would bring it under 0.9, but at most double
    dec = d.decide(PoolLoad(pred=3.0, actual=0.0, target=1.0, instances=2), 2, 0)
    assert dec.action == "up" and dec.count == 2
    d = PoolDecider(Role.PREFILL, ScalePolicy(up_sustain_s=0, cooldown_s=0, max_instances=8))
    dec = d.decide(PoolLoad(pred=1.2, actual=0.0, target=1.0, instances=4), 4, 0)
    assert dec.action == "up" and dec.count == 2  # 1.2 * 4/5 = 0.96 > 0.9, 1.2 * 4/6 = 0.8
    d = PoolDecider(Role.PREFILL, ScalePolicy(up_sustain_s=0, cooldown_s=0, max_instances=8))
    # high only because of the lagging measured TTFT: one step at a time
    dec = d.decide(PoolLoad(pred=0.5, actual=3.0, target=1.0, instances=2), 2, 0)
    assert dec.action == "up" and dec.count == 1


def test_decider_scales_down_a_pool_whose_floor_is_near_target() -> None:
    policy = ScalePolicy(down_load=0.35, up_load=0.9, down_sustain_s=10, cooldown_s=0, min_instances=1)
    d = PoolDecider(Role.DECODE, policy)
    # idle decode: TPOT floor 0.6 of target; with one fewer instance the load stays at the floor
    idle = PoolLoad(pred=0.6, actual=0.0, target=1.0, instances=3, floor=0.6)
    acts = [d.decide(idle, 3, t).action for t in range(0, 15, 5)]
    assert acts == ["hold", "hold", "down"]
    busy = PoolLoad(pred=0.85, actual=0.0, target=1.0, instances=2, floor=0.6)
    d = PoolDecider(Role.DECODE, policy)
    assert all(d.decide(busy, 2, t).action == "hold" for t in range(0, 100, 5))


def test_decider_ignores_load_that_more_instances_cannot_remove() -> None:
    policy = ScalePolicy(up_sustain_s=0, down_sustain_s=10, cooldown_s=0, min_instances=1, max_instances=4)
    d = PoolDecider(Role.PREFILL, policy)
    # idle, but a lone request already takes 1.5x the target: adding instances would not help
    idle = PoolLoad(pred=1.5, actual=0.0, target=1.0, instances=2, floor=1.5)
    acts = [d.decide(idle, 2, t).action for t in range(0, 15, 5)]
    assert "up" not in acts and acts[-1] == "down"
    d = PoolDecider(Role.PREFILL, policy)
    queued = PoolLoad(pred=3.0, actual=0.0, target=1.0, instances=2, floor=1.5)
    assert d.decide(queued, 2, 0).action == "up"


def test_decider_repairs_below_minimum_immediately() -> None:
    d = PoolDecider(Role.PREFILL, ScalePolicy(min_instances=2, max_instances=3))
    assert d.decide(pl(0.0, 1), 1, 0).action == "up"


@settings(max_examples=80, deadline=None)
@given(loads=st.lists(st.floats(min_value=0, max_value=5), min_size=1, max_size=60),
       start=st.integers(min_value=1, max_value=3))
def test_decider_never_leaves_bounds_and_never_acts_within_cooldown(loads: list[float], start: int) -> None:
    d = PoolDecider(Role.PREFILL, POLICY)
    n, last = start, -1e9
    for k, load in enumerate(loads):
        t = k * 5.0
        dec = d.decide(pl(load, n), n, t)
        if dec.action != "hold":
            assert t - last >= POLICY.cooldown_s
            last = t
        n += {"up": 1, "down": -1, "hold": 0}[dec.action]
        assert POLICY.min_instances <= n <= POLICY.max_instances


def test_decider_does_not_flap_under_steady_load() -> None:
    for load in (0.2, 0.5, 0.7, 0.95, 1.5):
        d = PoolDecider(Role.PREFILL, POLICY)
        n, actions = 2, []
        for k in range(200):
            # steady total work: the pool's load scales with 2/n
            dec = d.decide(pl(load * 2 / n, n), n, k * 5.0)
            n += {"up": 1, "down": -1, "hold": 0}[dec.action]
            actions.append(dec.action)
        changes = [a for a in actions if a != "hold"]
        # it converges: at most a monotone run of changes, then nothing
        assert len(changes) <= 2 and len(set(changes)) <= 1, (load, changes)


class FakeActuator:
    def __init__(self) -> None:
        self.added: list[Role] = []
        self.removed: list[str] = []

    def add(self, role: Role) -> str:
        self.added.append(role)
        return f"http://new{len(self.added)}:1"

    def remove(self, url: str, role: Role) -> None:
        self.removed.append(url)


def test_controller_adds_then_drains_before_removing() -> None:
    clock = Clock()
    reg = Registry()
    act = FakeActuator()
    loads = {Role.PREFILL: 2.0, Role.DECODE: 0.1}
    ctl = ScalingController(reg, act, POLICY,
                            lambda r: pl(loads[r], max(1, len(reg.pool(r)))),
                            (Role.PREFILL, Role.DECODE), clock=clock)
    p0 = reg.add(healthy("http://p0:1", Role.PREFILL))
    d0 = reg.add(healthy("http://d0:1", Role.DECODE))
    d1 = reg.add(healthy("http://d1:1", Role.DECODE, managed=True))
    d1.in_flight = 2
    for _ in range(4):
        ctl.step()
        clock.t += 5
    assert act.added == [Role.PREFILL]
    new = reg.get("http://new1:1")
    assert new is not None and new.managed and new.health is Health.STARTING
    for _ in range(4):
        ctl.step()
        clock.t += 5
    # the decode pool was idle long enough: its managed instance drains, it is not stopped yet
    assert d1.health is Health.DRAINING and act.removed == []
    ctl.step()
    assert act.removed == [] and "http://d1:1" in reg
    d1.in_flight = 0
    clock.t += 5
    ctl.step()
    assert act.removed == ["http://d1:1"] and "http://d1:1" not in reg
    assert d0.health is Health.HEALTHY and p0.health is Health.HEALTHY


class SwitchingActuator(FakeActuator):
    def __init__(self, ok: bool = True) -> None:
        super().__init__()
        self.ok = ok
        self.switched: list[tuple[str, Role, Role]] = []

    def switch(self, url: str, old: Role, new: Role) -> bool:
        self.switched.append((url, old, new))
        return self.ok


def test_controller_lends_an_idle_instance_across_pools_by_switching_its_role() -> None:
    clock = Clock()
    reg = Registry()
    act = SwitchingActuator()
    loads = {Role.PREFILL: 2.0, Role.DECODE: 0.1}  # prefill overloaded, decode idle
    ctl = ScalingController(reg, act, POLICY, lambda r: pl(loads[r], max(1, ctl.size(r))),
                            (Role.PREFILL, Role.DECODE), clock=clock, role_switch=True)
    reg.add(healthy("http://p0:1", Role.PREFILL))
    reg.add(healthy("http://d0:1", Role.DECODE))
    d1 = reg.add(healthy("http://d1:1", Role.DECODE))
    d1.in_flight = 1  # busier: the idle d0 is lent
    for _ in range(4):  # sustain, then lend (drain starts), then the drained instance switches
        ctl.step()
        clock.t += 5
    assert act.added == [] and act.switched == [("http://d0:1", Role.DECODE, Role.PREFILL)]
    moved = reg.get("http://d0:1")
    assert moved is not None and moved.role is Role.PREFILL and moved.health is Health.STARTING
    assert ctl.size(Role.PREFILL) == 2 and ctl.size(Role.DECODE) == 1
    # the decode pool is at its minimum now: the next shortage is met by starting an instance
    clock.t += 100
    ctl.step()
    assert act.added == [Role.PREFILL] and len(act.switched) == 1


def test_a_failed_switch_returns_the_instance_to_its_pool() -> None:
    clock = Clock()
    reg = Registry()
    act = SwitchingActuator(ok=False)
    loads = {Role.PREFILL: 2.0, Role.DECODE: 0.1}
    ctl = ScalingController(reg, act, POLICY, lambda r: pl(loads[r], max(1, ctl.size(r))),
                            (Role.PREFILL, Role.DECODE), clock=clock, role_switch=True)
    reg.add(healthy("http://p0:1", Role.PREFILL))
    reg.add(healthy("http://d0:1", Role.DECODE))
    reg.add(healthy("http://d1:1", Role.DECODE))
    for _ in range(4):
        ctl.step()
        clock.t += 5
    assert len(act.switched) == 1
    back = reg.get(act.switched[0][0])
    assert back is not None and back.role is Role.DECODE and not ctl.switching


def test_controller_drain_times_out() -> None:
    clock = Clock()
    reg = Registry()
    act = FakeActuator()
    ctl = ScalingController(reg, act, POLICY, lambda r: pl(0.0, 1), (Role.DECODE,), clock=clock)
    inst = reg.add(healthy("http://d:1", Role.DECODE, managed=True))
    reg.start_drain(inst.url, clock())
    inst.in_flight = 1
    assert ctl.finish_drains() == []
    clock.t += POLICY.drain_timeout_s
    assert ctl.finish_drains() == ["http://d:1"] and act.removed == ["http://d:1"]


def test_plugin_declares_every_config_field_and_builds_config() -> None:
    import dataclasses

    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.plugins.bigpd_router import hookimpls

    pm = KllmPluginManager(extra_plugins=[("bigpd_router", hookimpls)], load_entry_points=False)
    spec = pm.specs["bigpd_router"]
    assert [o.name for o in spec.options] == [f.name for f in dataclasses.fields(RouterConfig)]
    [ep] = pm.build(["bigpd_router"], environ={"KLLM_BIGPD_ROUTER_TTFT_TARGET_S": "0.25",
                                                "KLLM_BIGPD_ROUTER_POLICY": "round_robin"})
    assert ep.config == RouterConfig(ttft_target_s=0.25, policy="round_robin")
