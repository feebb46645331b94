"""Unit tests (no SGLang): the standby pool's choices and book-keeping, and the standby actuator
against real fake-backend processes (the router's SGLang stand-in) behind a real router."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
import time

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.actuators.standby_actuator import StandbyActuator, http_json
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Registry, Role
from kllm_plugins.plugins.bigpd_router.core.scaling import ScalePolicy, ScalingController
from kllm_plugins.plugins.bigpd_router.core.slo_load import PoolLoad
from kllm_plugins.plugins.bigpd_router.core.standby_pool import (
    MovingTime,
    StandbyEmpty,
    StandbyPolicy,
    StandbyPool,
    StartTimes,
    State,
)
from kllm_plugins.plugins.bigpd_router.service.router import Router

from bigpd_router_fixtures import Clock

GB = 1 << 30
FAKE = "kllm_plugins.plugins.bigpd_router.service.fake_backend"


def test_choice_follows_the_pool_state_and_the_measured_times() -> None:
    clock = Clock()
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 2}), StartTimes(cold_prior_s=30), clock)
    c = pool.choose(Role.PLAIN)
    assert c.kind == "cold" and "no plain standby" in c.reason
    pool.add_warming("http://a", Role.PLAIN)
    clock.t += 12
    c = pool.choose(Role.PLAIN)
    assert (c.kind, c.url) == ("wait", "http://a") and c.expected_s == pytest.approx(18)
    pool.mark_ready("http://a")
    assert pool.times.cold_s(Role.PLAIN) == pytest.approx(12)  # the measured start replaced the prior
    c = pool.choose(Role.PLAIN)
    assert (c.kind, c.url) == ("promote", "http://a")
    # a promotion measured slower than a cold start is not chosen
    pool.times.observe_promote(Role.PLAIN, 40.0)
    assert pool.choose(Role.PLAIN).kind == "cold"
    # other pools are not touched
    assert pool.choose(Role.DECODE).kind == "cold"


def test_moving_time_prior_then_average() -> None:
    m = MovingTime(30.0, alpha=0.5)
    m.observe(10.0)
    assert m.value == 10.0
    m.observe(20.0)
    assert m.value == 15.0
    m.observe(-1)  # ignored
    assert m.samples == 2
    with pytest.raises(ValueError, match="alpha"):
        MovingTime(1.0, alpha=0)


def test_memory_budget_bounds_the_pool_and_returns() -> None:
    clock = Clock()
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 4}, max_memory_bytes=int(2.5 * GB)), clock=clock)
    assert pool.want(Role.PLAIN) == 1  # nothing measured: one at a time
    pool.add_warming("http://a", Role.PLAIN)
    assert pool.want(Role.PLAIN) == 0
    assert pool.mark_ready("http://a", memory_bytes=GB)
    assert pool.want(Role.PLAIN) == 1  # (2.5 - 1) // 1
    pool.add_warming("http://b", Role.PLAIN)
    assert pool.memory_bytes() == 2 * GB  # the warming one counts as a typical one
    assert pool.want(Role.PLAIN) == 0
    # a member measured bigger than the rest of the budget is refused
    assert not pool.mark_ready("http://b", memory_bytes=2 * GB)
    assert "http://b" not in pool.members and pool.refused_for_memory == 1
    assert not pool.accept_return("http://c", Role.PLAIN, memory_bytes=2 * GB)
    assert pool.accept_return("http://c", Role.PLAIN, memory_bytes=GB)
    assert pool.of(Role.PLAIN, State.READY)[-1].url == "http://c"
    with pytest.raises(ValueError, match="max_memory_bytes"):
        StandbyPolicy(max_memory_bytes=-1)
    with pytest.raises(ValueError, match="size"):
        StandbyPolicy(size={Role.PLAIN: -1})


def test_standby_seconds_and_refill_off() -> None:
    clock = Clock()
    pool = StandbyPool(StandbyPolicy(size={Role.PLAIN: 1}, refill=False), clock=clock)
    assert pool.want(Role.PLAIN) == 1
    pool.add_warming("http://a", Role.PLAIN)
    clock.t += 10
    pool.mark_ready("http://a")
    clock.t += 5
    assert pool.standby_seconds() == pytest.approx(15)
    pool.take("http://a")
    clock.t += 100
    assert pool.standby_seconds() == pytest.approx(15)  # serving time is not standby time
    assert pool.want(Role.PLAIN) == 0  # refill off: not replaced
    assert pool.accept_return("http://a", Role.PLAIN)
    clock.t += 3
    assert pool.standby_seconds() == pytest.approx(18)
    with pytest.raises(StandbyEmpty, match="no longer in the pool"):
        pool.take("http://zzz")
    assert not pool.accept_return("http://b", Role.PLAIN)  # full again


class _Act:
    def __init__(self) -> None:
        self.n = 0
        self.removed: list[str] = []

    def add(self, role: Role) -> str:
        self.n += 1
        return f"http://i{self.n}"

    def remove(self, url: str, role: Role) -> None:
        self.removed.append(url)

    def standby_seconds(self, now: float) -> float:
        return 7.0


def test_controller_instance_seconds_count_serving_and_standby() -> None:
    clock = Clock()
    reg = Registry()
    act = _Act()
    pol = ScalePolicy(min_instances=1, max_instances=2, cooldown_s=0, up_sustain_s=0, down_sustain_s=0)
    ctl = ScalingController(reg, act, pol, lambda r: PoolLoad(0.0, 0.0, 1.0, len(reg.pool(r))), (Role.PLAIN,),
                            clock=clock)
    ctl.step()  # below minimum: one added
    assert len(reg) == 1
    clock.t += 20
    assert ctl.instance_seconds() == {"serving": 20.0, "standby": 7.0, "total": 27.0}
    inst = next(iter(reg))
    reg.start_drain(inst.url, clock.t)
    clock.t += 5
    ctl.finish_drains()
    clock.t += 50
    assert act.removed == [inst.url]
    assert ctl.instance_seconds()["serving"] == pytest.approx(25.0)


def _actuator(size: int, refill: bool = True, args: tuple[str, ...] = ()) -> StandbyActuator:
    base = LocalProcessActuator("unused", module=FAKE, stop_grace_s=5, common_args=args)
    # the fake backend starts in about half a second, faster than the default promotion prior (1 s),
    # and the pool would rightly prefer a cold start: the prior here is what a promotion costs
    times = StartTimes(promote_prior_s=0.001)
    return StandbyActuator(base, StandbyPool(StandbyPolicy(size={Role.PLAIN: size}, refill=refill), times),
                           warm_request=True, poll_s=0.1)


def _fill(act: StandbyActuator, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(act.pool.of(Role.PLAIN, State.READY)) < n:
        assert time.monotonic() < deadline, "standby not ready in time"
        act.fill_once()
        time.sleep(0.1)


@pytest.mark.slow
def test_standby_of_a_server_without_tokenizer_warms_up_with_token_ids(caplog: pytest.LogCaptureFixture) -> None:
    """--skip-tokenizer-init (the GPU benchmarks' config-only model): SGLang answers a text prompt
    400, and a text-only warm-up left the standby warming until its ready timeout."""
    act = _actuator(1, refill=False, args=("--skip-tokenizer-init",))
    try:
        with caplog.at_level(logging.WARNING, logger="kllm.bigpd_router.standby_actuator"):
            _fill(act, 1, timeout_s=30)
        assert not any("refused its warm-up" in r.getMessage() for r in caplog.records)
        url = act.pool.of(Role.PLAIN, State.READY)[0].url
        assert http_json(url + "/generate", {"text": "x"})[0] == 400  # the server does refuse text
    finally:
        act.stop_all()


@pytest.mark.slow
def test_actuator_promotes_returns_stops_and_falls_back_cold(caplog: pytest.LogCaptureFixture) -> None:
    act = _actuator(1, refill=False)
    try:
        with pytest.raises(StandbyEmpty, match="no plain standby"):
            act.promote(Role.PLAIN)
        _fill(act, 1)
        ready = act.pool.of(Role.PLAIN, State.READY)[0]
        assert ready.memory_bytes > 0 and act.pool.times.cold.get(Role.PLAIN) is not None
        url = act.add(Role.PLAIN)
        assert url == ready.url and act.choices[url].kind == "promote" and act.base.alive(url)
        assert act.pool.times.promote[Role.PLAIN].samples == 1
        assert act.pool.want(Role.PLAIN) == 0  # refill off
        with caplog.at_level(logging.WARNING, logger="kllm.bigpd_router.standby_actuator"):
            cold = act.add(Role.PLAIN)  # empty pool: a clear warning and a cold start
        assert cold != url and act.choices[cold].kind == "cold" and act.pool.cold_fallbacks == 1
        assert any("starting a plain instance cold" in r.getMessage() for r in caplog.records)
        act.remove(url, Role.PLAIN)  # the pool is short: back in as ready, still running
        assert act.base.alive(url) and act.pool.members[url].state is State.READY
        act.remove(cold, Role.PLAIN)  # the pool is full: stopped
        assert not act.base.alive(cold) and cold not in act.pool.members
    finally:
        act.stop_all()
    assert not act.base.procs


@pytest.mark.slow
def test_router_registers_a_promoted_standby_at_once_and_counts_its_standby_time() -> None:
    async def go() -> None:
        act = _actuator(1)
        # health rounds 60 s apart: only the check right after the scale step can make it healthy
        cfg = RouterConfig(health_interval_s=60, scale_interval_s=0.1, min_instances=0, max_instances=1,
                           loads_interval_s=0, scale_cooldown_s=0)
        router = Router(cfg, act, (Role.PLAIN,))
        try:
            await asyncio.to_thread(_fill, act, 1)
            act.start()
            async with router.serving() as rurl:
                assert router.controller is not None
                dec = router.controller.deciders[Role.PLAIN]
                dec.policy = dataclasses.replace(dec.policy, min_instances=1)
                deadline = time.monotonic() + 30
                while not router.registry.pool(Role.PLAIN, routable_only=True):
                    assert time.monotonic() < deadline, "promoted standby never became routable"
                    await asyncio.sleep(0.05)
                inst = router.registry.pool(Role.PLAIN)[0]
                assert inst.health is Health.HEALTHY and act.choices[inst.url].kind == "promote"
                async with aiohttp.ClientSession() as s:
                    async with s.post(rurl + "/generate", json={"text": "hi", "sampling_params": {
                            "max_new_tokens": 3}}) as r:
                        assert r.status == 200 and r.headers["X-Kllm-Instance"] == inst.url
                secs = router.controller.instance_seconds()
                assert secs["standby"] > 0 and secs["serving"] > 0
                assert secs["total"] == pytest.approx(secs["standby"] + secs["serving"])
                # the pool refills behind the promotion
                deadline = time.monotonic() + 60
                while not act.pool.of(Role.PLAIN, State.READY):
                    assert time.monotonic() < deadline, "pool not refilled"
                    await asyncio.sleep(0.1)
        finally:
            await asyncio.to_thread(act.stop_all)

    asyncio.run(go())



def test_core_module_imports_without_sglang() -> None:
    code = ("import sys; sys.modules['sglang'] = None; "
            "import kllm_plugins.plugins.bigpd_router.core.standby_pool, kllm_plugins.plugins.bigpd_router.core.scaling")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_builds_a_standby_actuator_and_refuses_a_bad_size() -> None:
    from kllm_plugins.plugins.bigpd_router.service.cli import build_parser, make_actuator

    act = make_actuator(build_parser().parse_args(["--actuator", "local", "--local-model-path", "m",
                                                   "--local-standby", "prefill=0,decode=0",
                                                   "--local-standby-memory-gb", "2"]))
    try:
        assert isinstance(act, StandbyActuator)
        assert act.pool.policy.size == {Role.PREFILL: 0, Role.DECODE: 0}  # 0: the filler starts nothing here
        assert act.pool.policy.max_memory_bytes == 2 * GB
    finally:
        act.stop_all()
    with pytest.raises(SystemExit, match="--local-standby wants ROLE=N"):
        make_actuator(build_parser().parse_args(["--actuator", "local", "--local-model-path", "m",
                                                 "--local-standby", "prefill"]))
