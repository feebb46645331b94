"""End to end: cross-instance prefix reuse through a shared L3, two real SGLang servers at once.

Servers A and B share one L3: the plugin's file store on one folder, or the plugin's Mooncake
backend on one test-started master. A prefix prefilled on one server is served from L3 on the
other (whose L1 and L2 never saw it): cached tokens there, L3 hits counted in its stats, and the
output equal to transformers' greedy output (float32), i.e. to a run without tiers. Faults at
serving level: corrupted pages (file store) and the store lost mid-run (folder deleted, Mooncake
master killed) leave the output unchanged, and the log says why.

File store, selective persistence (`min_reuse` 2) across instances: A's prefill is the pages'
first sighting (skipped), B's the second (written by B, through the shared offer markers), and A
then loads them from L3. L3 store events (medium DISK, B's instance id) arrive on a subscriber.

Mooncake, under HiCache's default prefetch policy (`timeout`, where a prefetch that finds nothing
holds its request): a miss starts no prefetch (the backend's first-page probe), a hit still does
and loads the prefix, and after the master is lost the probe answers a miss.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from contextlib import ExitStack
from typing import Any, Callable

import msgspec
import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.hf_reference import hf_greedy
from kllm_plugins.plugins.kv_tiers.testing import (
    assert_loads_from_l3,
    flush,
    l3_args,
    mooncake_available,
    mooncake_master,
    wait_stats,
)
from kllm_plugins.testing.sglang_server import SGLangServer, free_port, start_all

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

PROMPT = list(range(20, 320))  # 300 tokens: 18 full pages of 16
PAGES = 18


def _wait(server: SGLangServer, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 15.0) -> dict[str, Any]:
    return wait_stats(server, pred, timeout_s)


def _servers(args: list[str], env: dict[str, str], stack: ExitStack,
             extra: dict[str, list[str]] | None = None) -> tuple[SGLangServer, SGLangServer]:
    a, b = (SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=args + (extra or {}).get(name, []),
                         env={**env, "KLLM_KV_TIERS_INSTANCE_ID": name}, startup_timeout_s=300)
            for name in ("A", "B"))
    start_all([a, b])
    for server in (a, b):
        stack.callback(server.stop)
    return a, b


def _expect_log(server: SGLangServer, pattern: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.grep_log(pattern) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert server.grep_log(pattern), server.log_tail(20)


ARGS = ["--page-size", "16", "--dtype", "float32", "--hicache-storage-prefetch-policy", "wait_complete"]
ENV = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls",
       # the L3 path itself is tested; learned fetch-or-recompute may rightly pick recompute here
       "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0"}


def test_file_store_shared_by_two_servers(tmp_path) -> None:
    import zmq

    ref = hf_greedy(tiny_llama_path(), [PROMPT], 6)[0]
    store = tmp_path / "l3"
    ports = {"A": free_port(), "B": free_port()}
    events = {n: ["--kv-events-config", json.dumps({"publisher": "kllm_tiers", "endpoint": f"tcp://127.0.0.1:{p}",
                                                    "bind": True, "topic": "kv"})] for n, p in ports.items()}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    for p in ports.values():
        sub.connect(f"tcp://127.0.0.1:{p}")
    try:
        with ExitStack() as stack:
            a, b = _servers(ARGS + l3_args("kllm_file"),
                            {**ENV, "KLLM_KV_TIERS_STORE_DIR": str(store), "KLLM_KV_TIERS_MIN_REUSE": "2",
                             "KLLM_KV_TIERS_WRITE_ALL_BELOW_PRESSURE": "false"},
                            stack, events)
            out = a.generate(input_ids=PROMPT, max_new_tokens=6)
            assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
            # First sighting: the 18 prompt pages are skipped. The 19th page (prompt end + output,
            # inserted at finish) extends a cached prefix and may be written at once; whether it is
            # counted yet when the 18 skips are depends on timing.
            assert _wait(a, lambda s: s["pages_skipped"] >= PAGES)["pages_admitted"] <= 1

            out = b.generate(input_ids=PROMPT, max_new_tokens=6)
            assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
            snap_b = _wait(b, lambda s: s["pages_admitted"] >= PAGES)  # second sighting, on B
            assert snap_b["pages_admitted"] >= PAGES, snap_b

            assert_loads_from_l3(a, PROMPT, ref, PAGES, 16, 15.0)  # A loads what B wrote

            files = sorted(store.rglob("*.kvp"))
            assert len(files) >= PAGES
            for f in files:  # corrupt every page
                raw = bytearray(f.read_bytes())
                raw[-1] ^= 0xFF
                f.write_bytes(bytes(raw))
            flush(a.base_url)
            out = a.generate(input_ids=PROMPT, max_new_tokens=6)
            assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] < PAGES * 16
            assert _wait(a, lambda s: s["store"]["faults"].get("corrupt", 0) >= 1)["store"]["faults"]["corrupt"] >= 1
            _expect_log(a, r"kv_tiers file store: page \w+ refused \(corrupt")

            shutil.rmtree(store)  # the store lost mid-run
            flush(a.base_url)
            out = a.generate(input_ids=PROMPT, max_new_tokens=6)
            assert out["output_ids"] == ref
            _expect_log(a, r"kv_tiers file store .* was missing; recreated it")

            stored: list[dict[str, Any]] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not stored:
                if sub.poll(500):
                    _topic, _seq, payload = sub.recv_multipart()
                    stored += [e for e in msgspec.msgpack.decode(payload)[1]
                               if e.get("medium") == "DISK" and e["type"] == "BlockStored"]
            assert stored, "no L3 BlockStored event received"
            assert {e["instance_id"] for e in stored} <= {"A", "B"} and stored[0]["block_hashes"]
    finally:
        sub.close(0)


# HiCache's default prefetch stop policy (`timeout`: a request waits for its L3 prefetch), with a
# long timeout so that a hit loads in full on a loaded machine too
MC_ARGS = ["--page-size", "16", "--dtype", "float32"]
MC_TIMEOUT_S = 30


def _no_miss_waited(snap: dict[str, Any]) -> bool:
    """No L3 prefetch that found nothing was started (so none held its request), and the probe
    is what kept it from starting."""
    w = snap["prefetch_wait"]
    return snap.get("prefetch_probe_miss", 0) >= 1 and w["misses"] == 0 and w["miss_seconds"] == 0


def test_mooncake_store_shared_by_two_servers(tmp_path) -> None:
    if not mooncake_available():
        pytest.skip("mooncake not installed (pip mooncake-transfer-engine-non-cuda)")
    ref = hf_greedy(tiny_llama_path(), [PROMPT], 6)[0]
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_master())
        a, b = _servers(MC_ARGS + l3_args("kllm_mooncake", master, prefetch_timeout_base=MC_TIMEOUT_S,
                                                 # a patient probe: the answer is tested, not its wait
                                                 probe_timeout_ms=2000),
                        {**ENV, "KLLM_KV_TIERS_MIN_REUSE": "1"}, stack)
        # a miss (nothing in L3 yet): the first-page probe starts no prefetch, so the request does
        # not wait for one (without the probe such misses waited 0.3-1.3 s each here)
        out = a.generate(input_ids=PROMPT, max_new_tokens=6)
        assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
        snap_a = _wait(a, lambda s: s["pages_admitted"] >= PAGES)
        assert snap_a["pages_admitted"] >= PAGES, snap_a
        assert _no_miss_waited(snap_a), snap_a

        out = b.generate(input_ids=PROMPT, max_new_tokens=6)
        assert out["output_ids"] == ref
        assert out["meta_info"]["cached_tokens"] >= PAGES * 16, out["meta_info"]
        snap_b = _wait(b, lambda s: s["store"]["hits"] >= PAGES)
        assert snap_b["store"]["hits"] >= PAGES and not snap_b["store"]["faults"], snap_b
        assert snap_b["instance_id"] == "B" and snap_b["backend"] == "mooncake"
        assert [ln for ln in b.grep_log(r"HiCache prefetch success") if f"loaded={PAGES * 16}" in ln]
        # the hit passed the probe: its prefetch was started and loaded the prefix
        snap_b = _wait(b, lambda s: s["prefetch_wait"]["loaded_tokens"] >= PAGES * 16)
        assert snap_b["prefetch_wait"]["loaded_tokens"] >= PAGES * 16 and snap_b["path_calls"]["probe"] >= 1, snap_b

        os.killpg(master["proc"].pid, signal.SIGKILL)  # the store lost mid-run
        master["proc"].wait(timeout=20)
        flush(b.base_url)
        missed = snap_b.get("prefetch_probe_miss", 0)
        out = b.generate(input_ids=PROMPT, max_new_tokens=6)
        assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] < PAGES * 16
        _expect_log(b, r"kv_tiers mooncake store: (lookup|read|write) of \d+ pages failed")
        snap_b = _wait(b, lambda s: s.get("prefetch_probe_miss", 0) > missed)  # the probe answered a miss
        assert snap_b.get("prefetch_probe_miss", 0) > missed and snap_b["prefetch_wait"]["misses"] == 0, snap_b
