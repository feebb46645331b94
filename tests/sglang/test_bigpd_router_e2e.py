"""End to end: kllm-router in front of real SGLang servers on the CPU platform.

Plain mode: two ordinary servers publishing KV events (ZMQ), affinity routing on those events,
the router's block index checked against them, streaming, and one server killed in the middle
of streams. PD mode: a prefill and a decode server paired by the router over
SGLang's bootstrap protocol with the Mooncake transfer engine on TCP; the decode side's greedy
output must equal the reference model's, which only holds if the KV really crossed over. Then
the controller swaps the two servers' roles with SGLang's /pd_role_switch and the output must
still equal the reference, with the KV now crossing the other way.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import aiohttp
import pytest

from kllm_plugins.plugins.bigpd_router.actuators.local_process import LocalProcessActuator
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Role
from kllm_plugins.plugins.bigpd_router.core.request_shape import parse
from kllm_plugins.plugins.bigpd_router.service.router import Router
from kllm_plugins.testing.sglang_server import PD_CPU_ENV, PORT_PLACEHOLDER, SGLangServer, pd_cpu_args, start_all

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


@contextlib.asynccontextmanager
async def running_router(cfg: RouterConfig, instances: list[tuple[str, Role | None]],
                         out: list[Router] | None = None, actuator: Any = None,
                         scaled: tuple[Role, ...] = ()) -> AsyncIterator[str]:
    router = Router(cfg, actuator, scaled)
    if out is not None:
        out.append(router)
    async with router.serving(shutdown_timeout_s=5) as url:
        for inst, role in instances:
            await router.add_instance(inst, role)
        yield url


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
        return r.status, await r.read(), r.headers.get("X-Kllm-Instance", "")


@pytest.fixture
def plain_pair(tiny_model_path: Path) -> Iterator[list[SGLangServer]]:
    """Two plain servers that publish their KV events over ZMQ (--kv-events-config)."""
    servers = [SGLangServer(tiny_model_path, max_total_tokens=4096, extra_args=[
        "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{PORT_PLACEHOLDER}", "topic": ""})])
        for _ in range(2)]
    start_all(servers)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_plain_mode_affinity_streaming_and_a_killed_instance(plain_pair: list[SGLangServer]) -> None:
    a, b = plain_pair
    cfg = RouterConfig(health_interval_s=0.5, health_failures=2, loads_interval_s=0.5, first_token_timeout_s=30,
                       max_retries=1)

    routers: list[Router] = []

    async def go() -> None:
        async with running_router(cfg, [(a.base_url, None), (b.base_url, None)], routers) as rurl, \
                aiohttp.ClientSession() as s:
            router = routers[0]
            lookups_before = router.metrics.kv_lookups._value.get()
            # 0. both instances describe their KV-event publishers: the router subscribes and loads
            # the tokenizer they report, so text prompts can be looked up in the block index
            assert all(i.kv_events for i in router.registry)
            assert router.kv_feed.tokenizer_loading is not None
            await asyncio.wait_for(router.kv_feed.tokenizer_loading, 120)  # slow on a busy 2-core machine
            assert router.kv_feed.has_tokenizer
            # 1. affinity (from KV events once they arrive): each prefix family stays on one
            # instance and hits SGLang's radix cache
            families = [f"You are assistant number {k}. " * 12 for k in range(4)]
            where: dict[int, set[str]] = {k: set() for k in range(4)}
            cached = 0
            for rep in range(3):
                for k, pre in enumerate(families):
                    st, body, inst = await post(s, rurl + "/generate", {
                        "text": pre + f"Question {rep}?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
                    assert st == 200, body
                    where[k].add(inst)
                    if rep:
                        cached += json.loads(body)["meta_info"]["cached_tokens"]
            assert all(len(v) == 1 for v in where.values()), where
            # (Sequential requests on an idle machine may all land on one instance: a new family
            # goes to the less loaded one, and both are idle. Spreading under load is unit-tested.)
            used = set().union(*where.values())
            assert cached > 8 * 40  # repeats were served mostly from the prefix cache
            # the block index, fed only by the servers' events, agrees with where the families went:
            # the router's token chain of a prompt equals the chain in SGLang's BlockStored events
            kv = router.kv_index.summary()
            assert all(kv[u]["blocks"] > 0 for u in used), kv
            for k, pre in enumerate(families):
                [home] = where[k]
                other = b.base_url if home == a.base_url else a.base_url
                ids = router.kv_feed.token_ids(parse("generate", json.dumps({"text": pre + "Question 0?"}).encode()))
                assert ids is not None
                got = router.kv_index.match(ids, [home, other])
                assert got.get(home, 0.0) > 0.9 and got.get(other, 0.0) < 0.5, (k, got)
            fresh = router.kv_feed.token_ids(parse("generate", b'{"text": "Nothing like any family above, at all."}'))
            assert fresh is not None and max(router.kv_index.match(fresh, [a.base_url, b.base_url]).values()) == 0
            assert router.metrics.kv_lookups._value.get() > lookups_before  # choices were made on the index

            # 2. OpenAI streaming through the router
            st, body, _ = await post(s, rurl + "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and events[-1] == b"data: [DONE]" and len(events) >= 5

            # 3. kill instance a in the middle of streams: every stream ends (done or explicit error)
            async def stream(i: int) -> bytes:
                st, body, _ = await post(s, rurl + "/generate", {
                    "text": f"long story {i}", "stream": True,
                    "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}})
                assert st == 200
                return body

            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.sleep(1.5)
            assert a.proc is not None
            os.killpg(a.proc.pid, signal.SIGKILL)
            bodies = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            for body in bodies:
                assert body.rstrip().endswith(b"[DONE]")
            assert any(b"upstream_error" in body for body in bodies) or all(
                b'"finish_reason"' in body for body in bodies)
            # afterwards everything is served by b
            for i in range(3):
                st, body, inst = await post(s, rurl + "/generate", {
                    "text": f"after {i}", "sampling_params": {"max_new_tokens": 2}})
                assert st == 200 and inst == b.base_url

    asyncio.run(go())


def mooncake_usable() -> str | None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing
        return f"mooncake transfer engine not importable: {exc}"
    return None


def start_pd_pair(tiny_model_path: Path) -> list[SGLangServer]:
    """A prefill and a decode server that can swap roles, started and healthy."""
    env = {**PD_CPU_ENV,
           # After a prefill -> decode /pd_role_switch, SGLang 0.5.23's idle invariant check on the
           # switched server reports the first transferred prompt's KV as leaked (150 tokens here;
           # seen 2026-11-30, also with the platform patch list off) and, strict by default, exits
           # the scheduler; whether that lands before or after the test's next request is timing.
           # Non-fatal here (a warning in the log); routing and greedy outputs are still asserted.
           "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
    # both servers can take either role (the test swaps them with /pd_role_switch), so the prefill
    # server also gets what a decode server needs on a CPU (`pd_cpu_args`): the cpu_tensor
    # retraction backup
    common = ["--dtype", "float32", "--enable-pd-role-switch"]
    prefill = SGLangServer(tiny_model_path, plugins=["bigpd_router"], env=env, max_total_tokens=4096, extra_args=[
        *pd_cpu_args("prefill"), "--disaggregation-decode-retraction-backup", "cpu_tensor", *common])
    decode = SGLangServer(tiny_model_path, plugins=["bigpd_router"], env=env, max_total_tokens=4096, extra_args=[
        *pd_cpu_args("decode"), *common])
    start_all([prefill, decode])
    return [prefill, decode]


@pytest.fixture
def pd_pair(tiny_model_path: Path) -> Iterator[list[SGLangServer]]:
    """A started pair in a list the test may swap for a fresh one; whatever it holds is stopped."""
    reason = mooncake_usable()
    if reason:
        pytest.skip(reason)
    pair = start_pd_pair(tiny_model_path)
    try:
        yield pair
    finally:
        for s in pair:
            s.stop()


async def until(cond: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


def role_and_health(router: Router, url: str) -> tuple[Role, Health] | None:
    inst = router.registry.get(url)
    return None if inst is None else (inst.role, inst.health)


def hf_greedy(model_path: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


class PostSwitchStall(AssertionError):
    """The first pair after the role swap sent no first token within the router's timeout (both of
    its attempts): seen once in CI (2026-12-06), not reproduced here in 15 runs (4 of them beside
    three busy loops); the servers' side of it is in the message."""


def test_pd_mode_over_mooncake_tcp_matches_reference(pd_pair: list[SGLangServer], tiny_model_path: Path) -> None:
    prompt = [(i * 37) % 4000 + 10 for i in range(150)]
    want = hf_greedy(tiny_model_path, prompt, 8)
    try:
        pd_scenario(pd_pair, tiny_model_path, prompt, want)
    except PostSwitchStall as exc:
        # One rerun on fresh servers for that stall only, said as a warning; any failure of the
        # rerun, the same stall included, fails the test.
        warnings.warn(f"PD pair stalled after the role swap; rerunning on a fresh pair:\n{exc}", stacklevel=1)
        for srv in pd_pair:
            srv.stop()
        pd_pair[:] = start_pd_pair(tiny_model_path)
        pd_scenario(pd_pair, tiny_model_path, prompt, want)


def pd_scenario(pair: list[SGLangServer], tiny_model_path: Path, prompt: list[int], want: list[int]) -> None:
    prefill, decode = pair
    assert prefill.grep_log(r"hooks applied (\d+)/\1")  # the CPU shim for Mooncake attached
    # the controller only carries out drains and role switches here (scale_interval_s=0: no scaling
    # decisions); its actuator is used for SGLang's /pd_role_switch only
    cfg = RouterConfig(health_interval_s=1.0, loads_interval_s=1.0, first_token_timeout_s=60, scale_interval_s=0,
                       scale_role_switch=True)
    routers: list[Router] = []

    async def go() -> None:
        async with running_router(cfg, [(prefill.base_url, None), (decode.base_url, None)], routers,
                                  LocalProcessActuator(str(tiny_model_path), role_switch=True),
                                  (Role.PREFILL, Role.DECODE)) as rurl, aiohttp.ClientSession() as s:
            async with s.get(rurl + "/health") as r:
                assert (await r.json())["mode"] == "pd"
            for attempt in range(2):  # the second one takes SGLang's cached-prefix early-send path
                st, body, inst = await post(s, rurl + "/generate", {
                    "input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
                assert st == 200, body
                assert inst == decode.base_url
                assert json.loads(body)["output_ids"] == want  # only true if the KV really crossed over
            st, body, _ = await post(s, rurl + "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": True})
            events = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert st == 200 and events[-1] == b"data: [DONE]" and len(events) >= 6, body[-300:]

            # swap the roles with SGLang's /pd_role_switch, driven by the controller (drain, flip,
            # rejoin as STARTING, health check): the former decode server now prefills and ships
            # its KV to the former prefill server, and greedy output still equals the reference
            router, ctl = routers[0], routers[0].controller
            assert ctl is not None
            for url, target in ((decode.base_url, Role.PREFILL), (prefill.base_url, Role.DECODE)):
                assert ctl.start_switch(url, target)
                await until(lambda u=url, t=target: role_and_health(router, u) == (t, Health.HEALTHY), 120)
            assert ctl.switching == {}
            for attempt in range(2):
                st, body, inst = await post(s, rurl + "/generate", {
                    "input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
                if st == 504 and b"no first token in time" in body:
                    raise PostSwitchStall(body.decode(errors="replace"))
                assert st == 200, body
                assert inst == prefill.base_url  # the old prefill server decodes now
                assert json.loads(body)["output_ids"] == want
            assert decode.grep_log(r"PD role switch succeeded: decode -> prefill")
            assert prefill.grep_log(r"PD role switch succeeded: prefill -> decode")
            new_prefill = decode

            # kill the prefill instance in the middle of a burst of streams: a stream whose KV had
            # crossed over finishes on the decode side, any other gets a clear error; none hangs
            async def stream(i: int) -> tuple[int, bytes]:
                async with s.post(rurl + "/generate", json={
                        "input_ids": [(i * 7919 + k * 31) % 4000 + 10 for k in range(300)], "stream": True,
                        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}},
                        timeout=aiohttp.ClientTimeout(total=150)) as r:
                    return r.status, await r.read()

            tasks = [asyncio.create_task(stream(i)) for i in range(6)]
            await asyncio.sleep(0.5)
            assert new_prefill.proc is not None
            os.killpg(new_prefill.proc.pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            for status, body in results:
                if status == 200:
                    assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
                else:
                    assert status in (502, 503, 504) and json.loads(body)["error"]["message"], body[:300]
            # with the only prefill gone, a new request is refused at once, not left waiting
            st, body, _ = await post(s, rurl + "/generate", {"input_ids": prompt,
                                                              "sampling_params": {"max_new_tokens": 2}})
            assert st in (502, 503) and json.loads(body)["error"]["message"]

    try:
        asyncio.run(go())
    except AssertionError as exc:  # the servers' side of a failure, for a CI log without the files
        raise type(exc)(f"{exc}\n{pd_log_excerpt(prefill, decode)}") from None


def pd_log_excerpt(*servers: SGLangServer) -> str:
    """The lines of the servers' logs that tell a failed handshake or role switch apart."""
    rx = r"role switch|leak|handshake|[Tt]ransfer|[Bb]ootstrap|Abort|abort|Error|Traceback|exit|crash|timed? ?out"
    parts = []
    for srv in servers:
        lines = [ln[:300] for ln in srv.grep_log(rx) if "server_args=" not in ln]
        parts.append(f"--- {srv.base_url} ({len(lines)} matching lines, last 40):\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)
