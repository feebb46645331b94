"""Unit tests (no SGLang): controller options added for the scaling target (trend look-ahead,
down-after-up, per-pool minimums), operator/lending role switches, and a role swap through the
router service against fake backends that, like SGLang 0.5.23, keep reporting their launch role."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.scaling import PoolDecider, ScalePolicy, ScalingController, slope
from kllm_plugins.plugins.bigpd_router.core.slo_load import PoolLoad
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.router import Router

sys.path.insert(0, str(Path(__file__).parent))
from bigpd_router_fixtures import Clock, healthy, serve  # noqa: E402

POLICY = ScalePolicy(up_load=0.9, down_load=0.4, up_sustain_s=4, down_sustain_s=10, cooldown_s=5,
                     min_instances=1, max_instances=4, drain_timeout_s=60)


def pl(load: float, n: int) -> PoolLoad:
    return PoolLoad(pred=load, actual=0.0, target=1.0, instances=n)


class Actuator:
    def __init__(self, switch_ok: bool = True) -> None:
        self.added: list[Role] = []
        self.removed: list[str] = []
        self.switched: list[tuple[str, Role, Role]] = []
        self.switch_ok = switch_ok

    def add(self, role: Role) -> str:
        self.added.append(role)
        return f"http://new{len(self.added)}:1"

    def remove(self, url: str, role: Role) -> None:
        self.removed.append(url)

    def switch(self, url: str, old: Role, new: Role) -> bool:
        self.switched.append((url, old, new))
        return self.switch_ok


# ---------------------------------------------------------------- trend look-ahead
@given(a=st.floats(-5, 5), b=st.floats(-2, 2), n=st.integers(3, 30))
@settings(max_examples=50, deadline=None)
def test_slope_recovers_a_line(a: float, b: float, n: int) -> None:
    pts = [(float(t), a + b * t) for t in range(n)]
    assert slope(pts) == pytest.approx(b, abs=1e-6)


def test_slope_needs_three_spread_samples() -> None:
    assert slope([(0.0, 0.0), (1.0, 5.0)]) == 0.0
    assert slope([(2.0, 0.0), (2.0, 1.0), (2.0, 3.0)]) == 0.0


def rising(decider: PoolDecider, start: float, step: float, times: range) -> list[str]:
    return [decider.decide(pl(start + step * k, 1), 1, float(t)).action for k, t in enumerate(times)]


def test_a_rising_prediction_scales_up_before_the_target_is_crossed() -> None:
    policy = dataclasses.replace(POLICY, trend_lookahead_s=10, trend_window_s=30)
    # predicted Load rises 0.05/s, from 0.3 to 0.65 over 7 s: never above up_load 0.9 itself
    with_trend = rising(PoolDecider(Role.PREFILL, policy), 0.3, 0.05, range(0, 8))
    without = rising(PoolDecider(Role.PREFILL, POLICY), 0.3, 0.05, range(0, 8))
    assert "up" in with_trend and "up" not in without
    # the projection is held to the same sustain as the load itself: not before up_sustain_s
    first = with_trend.index("up")
    assert first >= POLICY.up_sustain_s


def test_a_flat_or_falling_prediction_adds_nothing() -> None:
    policy = dataclasses.replace(POLICY, trend_lookahead_s=10, trend_window_s=30)
    d = PoolDecider(Role.PREFILL, policy)
    noisy = [0.5, 0.6, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6]
    assert all(d.decide(pl(v, 1), 1, float(t)).action == "hold" for t, v in enumerate(noisy))
    d2 = PoolDecider(Role.PREFILL, policy)
    assert all(d2.decide(pl(0.8 - 0.05 * t, 1), 1, float(t)).action == "hold" for t in range(10))


def test_the_step_is_sized_on_the_projection() -> None:
    policy = dataclasses.replace(POLICY, up_sustain_s=0, trend_lookahead_s=10, trend_window_s=30, max_instances=8)
    d = PoolDecider(Role.PREFILL, policy)
    acts = [d.decide(pl(0.5 + 0.1 * t, 2), 2, float(t)) for t in range(4)]
    up = next(a for a in acts if a.action == "up")
    # at t=2 the slope (0.1/s) is first known: projected 0.7 + 1.0 = 1.7 on 2 instances needs 4
    # (1.7 x 2/4 = 0.85 < 0.9), which is also the doubling limit; the current 0.7 alone needs none
    assert up.at == 2.0 and up.count == 2


# ---------------------------------------------------------------- down-after-up
def test_no_scale_down_soon_after_a_scale_up() -> None:
    policy = dataclasses.replace(POLICY, down_after_up_s=60, up_sustain_s=0, cooldown_s=0, down_sustain_s=0)
    d = PoolDecider(Role.DECODE, policy)
    assert d.decide(pl(3.0, 2), 2, 0.0).action == "up"
    for t in (1.0, 30.0, 59.0):
        assert d.decide(pl(0.0, 3), 3, t).action == "hold"
    assert d.decide(pl(0.0, 3), 3, 61.0).action == "down"
    plain = PoolDecider(Role.DECODE, dataclasses.replace(policy, down_after_up_s=0))
    assert plain.decide(pl(3.0, 2), 2, 0.0).action == "up"
    assert plain.decide(pl(0.0, 3), 3, 1.0).action == "down"


def test_policy_rejects_negative_new_fields() -> None:
    for name in ("trend_lookahead_s", "trend_window_s", "down_after_up_s"):
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(POLICY, **{name: -1.0})
    with pytest.raises(ValueError, match="trend_window_s"):
        dataclasses.replace(POLICY, trend_lookahead_s=5.0, trend_window_s=0.0)


# ---------------------------------------------------------------- per-pool minimums
def test_each_pool_keeps_its_own_minimum() -> None:
    reg = Registry()
    act = Actuator()
    clock = Clock()
    policies = {Role.PREFILL: dataclasses.replace(POLICY, min_instances=3),
                Role.DECODE: dataclasses.replace(POLICY, min_instances=1)}
    ctl = ScalingController(reg, act, policies, lambda r: pl(0.0, max(1, ctl.size(r))), (Role.PREFILL, Role.DECODE),
                            clock=clock)
    reg.add(healthy("http://p0:1", Role.PREFILL))
    reg.add(healthy("http://d0:1", Role.DECODE))
    reg.add(healthy("http://d1:1", Role.DECODE))
    for _ in range(30):  # idle for a long time: prefill grows to 3, decode shrinks to 1
        ctl.step()
        for inst in list(reg):
            if inst.health is Health.STARTING:
                inst.health = Health.HEALTHY
        clock.t += 5
    assert act.added == [Role.PREFILL, Role.PREFILL]
    assert ctl.size(Role.PREFILL) == 3 and ctl.size(Role.DECODE) == 1
    with pytest.raises(ValueError, match="no scaling policy"):
        ScalingController(reg, act, {Role.PREFILL: POLICY}, lambda r: pl(0.0, 1), (Role.PREFILL, Role.DECODE))


def test_config_pool_minimums_reach_the_router_controller() -> None:
    cfg = RouterConfig(min_instances=1, max_instances=4, min_prefill_instances=3, min_decode_instances=0,
                       scale_trend_lookahead_s=5, scale_down_after_up_s=90)
    assert cfg.pool_minimum("prefill") == 3 and cfg.pool_minimum("decode") == 0 and cfg.pool_minimum("plain") == 1
    router = Router(cfg, Actuator(), (Role.PREFILL, Role.DECODE))
    assert router.controller is not None
    pols = router.controller.policies
    assert pols[Role.PREFILL].min_instances == 3 and pols[Role.DECODE].min_instances == 0
    assert pols[Role.PREFILL].trend_lookahead_s == 5 and pols[Role.DECODE].down_after_up_s == 90
    with pytest.raises(ValueError, match="min_prefill_instances"):
        RouterConfig(max_instances=2, min_prefill_instances=3)
    with pytest.raises(ValueError, match="scale_trend_window_s"):
        RouterConfig(scale_trend_window_s=0)


# ---------------------------------------------------------------- operator switches
def test_start_switch_drains_then_flips_and_refuses_what_it_cannot() -> None:
    reg = Registry()
    act = Actuator()
    clock = Clock()
    ctl = ScalingController(reg, act, POLICY, lambda r: pl(0.5, 1), (Role.PREFILL, Role.DECODE), clock=clock,
                            role_switch=True)
    reg.add(healthy("http://p0:1", Role.PREFILL))
    d0 = reg.add(healthy("http://d0:1", Role.DECODE))
    plain = reg.add(healthy("http://x:1", Role.PLAIN))
    assert not ctl.start_switch(plain.url, Role.DECODE)  # not a PD instance
    assert not ctl.start_switch(d0.url, Role.DECODE)  # already there
    assert not ctl.start_switch("http://nowhere:1", Role.PREFILL)
    d0.in_flight = 1
    assert ctl.start_switch(d0.url, Role.PREFILL)
    assert d0.health is Health.DRAINING and not ctl.start_switch(d0.url, Role.PREFILL)  # already switching
    ctl.finish_drains()
    assert act.switched == []  # still busy
    d0.in_flight = 0
    ctl.finish_drains()
    assert act.switched == [("http://d0:1", Role.DECODE, Role.PREFILL)]
    moved = reg.get("http://d0:1")
    assert moved is not None and moved.role is Role.PREFILL and moved.health is Health.STARTING
    no_switch = ScalingController(Registry(), object(), POLICY, lambda r: pl(0.5, 1),  # type: ignore[arg-type]
                                  (Role.PREFILL, Role.DECODE), role_switch=True)
    no_switch.registry.add(healthy("http://d:1", Role.DECODE))
    assert not no_switch.start_switch("http://d:1", Role.PREFILL)  # the actuator cannot switch


# ---------------------------------------------------------------- a role swap through the service
def role_of(router: Router, url: str) -> Role | None:
    inst = router.registry.get(url)
    return None if inst is None else inst.role


def test_swapping_roles_through_the_router_keeps_pd_pairing_right() -> None:
    """Prefill P and decode D swap roles through the controller (drain, /pd_role_switch, rejoin).
    The fakes keep reporting their launch role in /server_info, as SGLang 0.5.23 does, so the
    router must keep the role it switched to and take D's bootstrap port for its new prefill role."""
    p = FakeBackend(role="prefill", bootstrap_port=9301, pd_role_switch=True)
    d = FakeBackend(role="decode", bootstrap_port=9302, pd_role_switch=True)
    cfg = RouterConfig(health_interval_s=0.1, loads_interval_s=0.1, health_failures=1, scale_interval_s=0,
                       scale_role_switch=True)

    async def wait_for(cond: object, timeout_s: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not cond():  # type: ignore[operator]
            assert asyncio.get_running_loop().time() < deadline, "condition not reached"
            await asyncio.sleep(0.05)

    async def go() -> None:
        async with serve(p.app()) as purl, serve(d.app()) as durl:
            router = Router(cfg, LocalProcessActuator("unused", role_switch=True), (Role.PREFILL, Role.DECODE))
            async with router.serving() as rurl, aiohttp.ClientSession() as s:
                await router.add_instance(purl)
                await router.add_instance(durl)
                assert router.registry.get(durl).bootstrap_port is None  # a decode instance needs none
                ctl = router.controller
                assert ctl is not None
                assert ctl.start_switch(durl, Role.PREFILL)
                await wait_for(lambda: d.role == "prefill" and role_of(router, durl) is Role.PREFILL)
                assert ctl.start_switch(purl, Role.DECODE)
                await wait_for(lambda: p.role == "decode" and role_of(router, purl) is Role.DECODE)
                await wait_for(lambda: all(i.health is Health.HEALTHY for i in router.registry))
                # /server_info still says P is prefill and D decode; the router keeps the switched roles
                async with s.get(durl + "/server_info") as r:
                    assert (await r.json())["disaggregation_mode"] == "decode"
                assert router.registry.get(durl).bootstrap_port == 9302
                before = len(p.requests), len(d.requests)
                async with s.post(rurl + "/generate", data=json.dumps({"text": "hi", "sampling_params": {
                        "max_new_tokens": 3}}).encode(), headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200 and r.headers["X-Kllm-Instance"] == purl  # the decode side answers
                [dreq] = p.requests[before[0]:]
                [preq] = d.requests[before[1]:]
                assert dreq["body"]["bootstrap_port"] == 9302  # D's bootstrap server, not P's old one
                assert dreq["body"]["bootstrap_room"] == preq["body"]["bootstrap_room"]

    asyncio.run(asyncio.wait_for(go(), 120))


def test_add_instance_with_a_role_other_than_reported() -> None:
    plain_decode = FakeBackend(role="decode")
    switching = FakeBackend(role="decode", pd_role_switch=True)

    async def go() -> None:
        async with serve(plain_decode.app()) as u1, serve(switching.app()) as u2:
            router = Router(RouterConfig(health_interval_s=0.1))
            async with router.serving():
                with pytest.raises(ValueError, match="reports role decode"):
                    await router.add_instance(u1, Role.PREFILL)
                inst = await router.add_instance(u2, Role.PREFILL)  # switched earlier: trusted
                assert inst.role is Role.PREFILL and inst.bootstrap_port == switching.bootstrap_port

    asyncio.run(asyncio.wait_for(go(), 30))


def test_local_actuator_sends_the_graph_headroom_on_a_switch_to_decode() -> None:
    fb = FakeBackend(role="prefill", pd_role_switch=True)

    async def go() -> None:
        async with serve(fb.app()) as url:
            assert not await asyncio.to_thread(  # SGLang refuses a flip to decode without the headroom field
                LocalProcessActuator("unused", role_switch=True, decode_graph_memory_gb=None).switch,
                url, Role.PREFILL, Role.DECODE)
            assert fb.role == "prefill"
            assert await asyncio.to_thread(LocalProcessActuator("unused", role_switch=True).switch, url,
                                           Role.PREFILL, Role.DECODE)
            assert fb.role == "decode"

    asyncio.run(asyncio.wait_for(go(), 30))


def test_local_actuator_retries_a_switch_refused_while_the_instance_is_not_idle() -> None:
    """The router's drain covers only its own requests: SGLang may still hold a health check or a
    finishing stream, refuse the flip as not idle (nothing torn down) and take it once idle."""
    fb = FakeBackend(role="decode", pd_role_switch=True, running=1)
    act = LocalProcessActuator("unused", role_switch=True, switch_retry_s=0.05)

    async def go() -> None:
        async with serve(fb.app()) as url:
            # still busy when the time is up: refused, role kept
            assert not await asyncio.to_thread(act.switch, url, Role.DECODE, Role.PREFILL, 0.3)
            assert fb.role == "decode"
            asyncio.get_running_loop().call_later(0.3, setattr, fb, "running", 0)
            assert await asyncio.to_thread(act.switch, url, Role.DECODE, Role.PREFILL, 10.0)
            assert fb.role == "prefill"

    asyncio.run(asyncio.wait_for(go(), 30))


def test_instances_registered_at_start_up_are_not_mistaken_for_an_empty_pool() -> None:
    """The scaling loop waits one period before deciding: instances given on the command line are
    registered just after the loops start, and an empty pool would look below its minimum."""
    fb = FakeBackend()
    act = Actuator()
    # a period long enough for the registration to finish first even on a loaded machine
    cfg = RouterConfig(health_interval_s=0.1, loads_interval_s=0, scale_interval_s=2.0, min_instances=1,
                       max_instances=2)

    async def go() -> None:
        async with serve(fb.app()) as url:
            router = Router(cfg, act, (Role.PLAIN,))
            async with router.serving():
                await router.add_instance(url)
                await asyncio.sleep(4.5)  # two decisions
            assert act.added == []

    asyncio.run(asyncio.wait_for(go(), 30))
