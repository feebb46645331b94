"""Unit tests (no SGLang): the KV-event block index, prefill choice on it, and the ZMQ feed.

Events are built in SGLang's wire shape (tagged msgpack maps in `[ts, [events], dp_rank]`
batches, multipart `(topic, seq, payload)`) and published from a real ZMQ PUB socket.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.plugins.bigpd_router.core.kv_index import MEDIUM_WEIGHT, KvIndex
from kllm_plugins.plugins.bigpd_router.core.pairing import Picker
from kllm_plugins.plugins.bigpd_router.core.prefix_tree import PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance, Role
from kllm_plugins.plugins.bigpd_router.service.fake_backend import FakeBackend
from kllm_plugins.plugins.bigpd_router.service.kv_events import sub_endpoints

from test_bigpd_router_service import cluster, post, run  # type: ignore[import-not-found]

A, B = "http://a:1", "http://b:1"


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, medium: str | None = "GPU",
           size: int = 4) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": tokens, "block_size": size, "lora_id": None}
    if medium is not None:
        ev["medium"] = medium
    return ev


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_index_follows_store_chain_remove_and_clear() -> None:
    idx = KvIndex()
    prompt = list(range(1, 23))  # 22 tokens: 5 whole blocks of 4
    idx.apply(A, [stored([101, 102, 103, 104], list(range(1, 17)))])
    assert idx.match(prompt, [A, B]) == {A: 4 / 5}  # B publishes nothing: not in the answer
    idx.apply(A, [stored([105], [17, 18, 19, 20], parent=104)])  # continues the chain
    assert idx.match(prompt, [A]) == {A: 1.0}
    assert idx.match([1, 2, 3, 4, 9, 9, 9, 9], [A]) == {A: 0.5}  # diverges after the first of 2 blocks
    idx.apply(A, [removed([103])])
    assert idx.match(prompt, [A]) == {A: 2 / 5}  # a leading run only: blocks after the hole do not count
    idx.apply(A, [{"type": "AllBlocksCleared"}])
    assert idx.match(prompt, [A]) == {A: 0.0}


def test_medium_weights_and_l3_events_without_tokens() -> None:
    idx = KvIndex()
    toks = list(range(8))
    idx.apply(A, [stored([1, 2], toks)])
    idx.apply(B, [stored([7, 8], toks, medium="CPU_PINNED")])
    # kv_tiers' L3 events name blocks by engine hash only (no token ids, no parent)
    idx.apply(A, [stored([1, 2], [], medium="DISK")])
    assert idx.match(toks, [A, B]) == {A: 1.0, B: MEDIUM_WEIGHT["CPU_PINNED"]}
    idx.apply(A, [removed([1, 2], "GPU")])  # evicted from the GPU, still on disk
    assert idx.match(toks, [A]) == {A: pytest.approx(MEDIUM_WEIGHT["DISK"])}
    idx.apply(A, [removed([1, 2], "DISK")])
    assert idx.match(toks, [A]) == {A: 0.0}
    # an L3 event for a block never seen with its tokens cannot be placed: counted, ignored
    idx.apply(A, [stored([99], [], medium="DISK")])
    assert idx.summary()[A]["unknown"] == 1 and idx.summary()[A]["blocks"] == 0


def test_a_chain_whose_parent_was_never_seen_is_ignored() -> None:
    idx = KvIndex()
    idx.apply(A, [stored([5], [1, 2, 3, 4], parent=4242)])
    assert idx.match([1, 2, 3, 4], [A]) == {A: 0.0} and idx.summary()[A]["unknown"] == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove"]), st.integers(0, 5), st.integers(1, 4)),
                max_size=40),
       st.integers(0, 5), st.integers(1, 6))
def test_index_agrees_with_a_brute_force_model(ops: list[tuple[str, int, int]], family: int, length: int) -> None:
    """Random stores (chains of 1-4 blocks of one of 6 families) and removals against a set of stored prefixes."""
    idx = KvIndex()
    held: set[tuple[int, ...]] = set()  # token prefixes (whole blocks) the instance holds
    def tokens(fam: int, n: int) -> list[int]:
        return [fam * 1000 + i for i in range(4 * n)]

    def ehash(fam: int, i: int) -> int:
        return fam * 100 + i

    for op, fam, n in ops:
        if op == "store":
            # SGLang stores a chain below a parent that it holds: the longest held prefix of the family
            have = 0
            while have < 6 and tuple(tokens(fam, have + 1)) in held:
                have += 1
            new = list(range(have, min(6, have + n)))
            if not new:
                continue
            idx.apply(A, [stored([ehash(fam, i) for i in new], tokens(fam, new[-1] + 1)[4 * new[0]:],
                                 parent=ehash(fam, have - 1) if have else None)])
            held |= {tuple(tokens(fam, i + 1)) for i in new}
        else:
            idx.apply(A, [removed([ehash(fam, n - 1)])])
            held.discard(tuple(tokens(fam, n)))
    prompt = tokens(family, length)
    expect = 0
    while expect < length and tuple(tokens(family, expect + 1)) in held:
        expect += 1
    assert idx.match(prompt, [A]).get(A, 0.0) == pytest.approx(expect / length)


def healthy(url: str) -> Instance:
    inst = Instance(url=url, role=Role.PLAIN, health=Health.HEALTHY)
    inst.prefill_rate.update(1000.0)
    return inst


def test_picker_prefers_kv_event_matches_over_the_tree_and_gpu_over_disk() -> None:
    picker = Picker("slo_affinity", PrefixTree(block=8), ttft_target_s=1.0, tpot_target_s=0.1)
    a, b = healthy(A), healthy(B)
    prompt = "p" * 800
    picker.routed(prompt, b)  # the tree believes b holds it ...
    assert picker.pick_prefill([a, b], prompt, 200).instance is b
    # ... but both publish, and only a really holds it: the events win
    assert picker.pick_prefill([a, b], prompt, 200, known={A: 1.0, B: 0.0}).instance is a
    # the same prefix on a's disk and b's GPU: the GPU copy saves more prefill
    assert picker.pick_prefill([a, b], prompt, 200, known={A: MEDIUM_WEIGHT["DISK"], B: 1.0}).instance is b
    # an instance that does not publish keeps the tree's estimate
    assert picker.pick_prefill([a, b], prompt, 200, known={A: 0.0}).instance is b


def test_sub_endpoints_substitute_wildcards_and_count_dp_ranks() -> None:
    desc = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "", "block_size": 16,
            "dp_size": 2}
    assert sub_endpoints("http://10.1.2.3:30000", desc) == ["tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"]
    assert sub_endpoints("http://h:1", dict(desc, endpoint_host="10.9.9.9", dp_size=1)) == ["tcp://10.9.9.9:5557"]


def test_router_subscribes_to_published_events_and_routes_on_them() -> None:
    """Two fake instances describe ZMQ publishers in /server_info; a real PUB socket per instance sends
    SGLang-shaped batches; requests with input_ids go where the events say the prefix is."""
    ctx = zmq.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    ports = [p.bind_to_random_port("tcp://127.0.0.1") for p in pubs]
    seqs = [0, 0]
    enc = msgspec.msgpack.Encoder()

    def publish(i: int, events: list[dict[str, Any]]) -> None:
        pubs[i].send_multipart((b"", seqs[i].to_bytes(8, "big"), enc.encode([time.time(), events, 0])))
        seqs[i] += 1

    backends = [FakeBackend(kv_events={"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port,
                                       "topic": "", "block_size": 4, "dp_size": 1}) for port in ports]
    prompt = list(range(1, 33))  # 8 blocks

    async def go() -> None:
        cfg = RouterConfig(policy="slo_affinity", ttft_target_s=100.0, health_interval_s=0.2, loads_interval_s=0)
        async with cluster(backends, cfg) as (router, rurl, urls), aiohttp.ClientSession() as s:
            # ZMQ subscriptions join asynchronously: publish harmless events until both feeds deliver
            for _ in range(100):
                for i in range(2):
                    publish(i, [stored([999], [7, 7, 7, 7])])
                await asyncio.sleep(0.05)
                if all(router.kv_index.publishing(u) for u in urls):
                    break
            assert all(router.kv_index.publishing(u) for u in urls)
            lookups_before = router.metrics.kv_lookups._value.get()
            publish(1, [stored(list(range(10, 18)), prompt)])
            await asyncio.sleep(0.2)
            for _ in range(3):
                st, body, hdr = await post(s, rurl + "/generate", {"input_ids": prompt + [5],
                                                                   "sampling_params": {"max_new_tokens": 1}})
                assert st == 200 and hdr["X-Kllm-Instance"] == urls[1]
            # instance 1 evicts the prefix, instance 0 computes it: the next requests follow
            publish(1, [removed(list(range(10, 18)))])
            publish(0, [stored(list(range(20, 28)), prompt)])
            await asyncio.sleep(0.2)
            st, body, hdr = await post(s, rurl + "/generate", {"input_ids": prompt + [6],
                                                               "sampling_params": {"max_new_tokens": 1}})
            assert st == 200 and hdr["X-Kllm-Instance"] == urls[0]
            async with s.get(rurl + "/admin/loads") as r:
                kv = (await r.json())["kv_events"]
            assert kv[urls[0]]["blocks"] == 9 and kv[urls[1]]["blocks"] == 1
            # The counter lives in the process-wide Prometheus registry, which other tests in the
            # same process also count into: check this router's increment, and that /metrics shows it.
            assert router.metrics.kv_lookups._value.get() - lookups_before == 4
            async with s.get(rurl + "/metrics") as r:
                assert "kllm_bigpd_router_kv_lookups_total" in await r.text()
    try:
        run(go)
    finally:
        for p in pubs:
            p.close(0)
        ctx.term()


def test_kv_events_off_means_no_subscription() -> None:
    backends = [FakeBackend(kv_events={"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 1,
                                       "topic": "", "block_size": 4, "dp_size": 1})]

    async def go() -> None:
        async with cluster(backends, RouterConfig(kv_events=False, loads_interval_s=0)) as (router, _r, _u):
            assert not router.kv_feed._tasks and not router.kv_index.active
    run(go)


def test_kv_events_option_parses_booleans_from_cli_and_environment() -> None:
    from kllm_plugins.plugins.bigpd_router.service.cli import build_parser, config_from

    assert config_from(build_parser().parse_args(["--kv-events", "false"]), environ={}).kv_events is False
    assert config_from(build_parser().parse_args([]), environ={"KLLM_BIGPD_ROUTER_KV_EVENTS": "0"}).kv_events is False
    assert config_from(build_parser().parse_args([]), environ={}).kv_events is True
