"""End to end: HiCache with the kv_tiers file store on a real SGLang server on the CPU platform.

One server, one prompt, the device and host caches flushed between requests so that only L3
can serve the prefix:
  1. cold run (the reference output); its pages are offered to L3 and skipped (first sighting);
  2. after a flush: recomputed, looked up and offered again, now written (second sighting);
  3. after a flush: served from L3 (cached tokens), same output;
  4. every page file corrupted, flushed: the pages are refused (a fault, a log line), the
     prefix is recomputed and the output is still the same.
L3 store events arrive on a ZMQ subscriber through the `kllm_tiers` publisher, with medium DISK
and the instance id.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.sglang_server import SGLangServer, free_port

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

ADAPTER = "kllm_plugins.plugins.kv_tiers.sglang_adapter"
PROMPT = list(range(10, 310))  # 300 tokens: 18 full pages of 16


def _flush(server: SGLangServer, timeout_s: float = 60.0) -> None:
    """Flush L1 and L2; SGLang answers 400 while storage operations are still in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{server.base_url}/flush_cache", data=b"", timeout=60) as r:
                assert r.status == 200
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _stats(server: SGLangServer) -> dict[str, Any]:
    procs = server.get_json("/kllm/stats")["kv_tiers"]["processes"]
    assert len(procs) == 1
    return next(iter(procs.values()))


def _wait_stats(server: SGLangServer, pred: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = _stats(server)
        if pred(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.3)


def test_l3_file_store_serves_refuses_corruption_and_publishes_events(tmp_path: Path) -> None:
    import zmq

    store = tmp_path / "l3"
    events_port = free_port()
    extra = {"backend_name": "kllm_file", "module_path": ADAPTER, "class_name": "KllmFileStorage"}
    args = [
        "--page-size", "16", "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "layer_first", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
        # deterministic L3 reads: wait for each prefetch instead of timing it out on a busy CI box
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--kv-events-config", json.dumps({"publisher": "kllm_tiers", "endpoint": f"tcp://127.0.0.1:{events_port}",
                                          "bind": True, "topic": "kv"}),
    ]
    env = {
        "KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls",
        "KLLM_KV_TIERS_STORE_DIR": str(store),
        "KLLM_KV_TIERS_MIN_REUSE": "2",
        "KLLM_KV_TIERS_INSTANCE_ID": "e2e-instance",
        # this test checks the L3 path itself; the learned fetch-or-recompute thresholds (unit
        # tested) may rightly choose recompute on a loaded machine, so they are held fixed here
        "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0",
    }
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        with SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=args, env=env,
                          startup_timeout_s=300) as server:
            ref = server.generate(input_ids=PROMPT, max_new_tokens=6)["output_ids"]

            _flush(server)
            second = server.generate(input_ids=PROMPT, max_new_tokens=6)
            assert second["output_ids"] == ref
            snap = _wait_stats(server, lambda s: s.get("pages_admitted", 0) >= 18)
            assert snap["pages_skipped"] >= 18, snap  # first offer skipped
            assert snap["pages_admitted"] >= 18, snap  # second offer written
            files = sorted(store.rglob("*.kvp"))
            assert len(files) >= 18

            _flush(server)
            third = server.generate(input_ids=PROMPT, max_new_tokens=6)
            assert third["output_ids"] == ref
            assert third["meta_info"]["cached_tokens"] >= 288  # the 18 full pages came from L3
            snap = _wait_stats(server, lambda s: s["store"]["hits"] >= 18)
            assert snap["store"]["hits"] >= 18 and not snap["store"]["faults"], snap

            for f in files:  # flip a byte in every page's payload
                raw = bytearray(f.read_bytes())
                raw[-1] ^= 0xFF
                f.write_bytes(bytes(raw))
            _flush(server)
            fourth = server.generate(input_ids=PROMPT, max_new_tokens=6)
            assert fourth["output_ids"] == ref
            assert fourth["meta_info"]["cached_tokens"] < 288
            snap = _wait_stats(server, lambda s: s["store"]["faults"].get("corrupt", 0) >= 1)
            assert snap["store"]["faults"].get("corrupt", 0) >= 1, snap
            assert server.grep_log(r"kv_tiers file store: page \w+ refused \(corrupt")

            stored: list[dict[str, Any]] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not stored:
                if sub.poll(500):
                    _topic, _seq, payload = sub.recv_multipart()
                    batch = msgspec.msgpack.decode(payload)
                    stored += [e for e in batch[1] if e.get("medium") == "DISK" and e["type"] == "BlockStored"]
            assert stored, "no L3 BlockStored event received"
            assert stored[0]["instance_id"] == "e2e-instance" and stored[0]["block_hashes"]
    finally:
        sub.close(0)
