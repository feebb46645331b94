"""End to end: L3-loaded L2 spans kept until admission (kv_tiers' admission hold), one real server.

The scene, on a server with a small device pool (L1) and a host pool (L2) twice its size: six
prefixes are in L3 and nowhere else; a long request fills most of L1 and decodes, so the six
requests that reuse those prefixes, sent while it runs, wait in the queue. Their L3 prefetches
finish while they wait, and HiCache inserts each loaded span into the host tree unlocked; the
spans of all six do not fit the host room the long request leaves, so without the hold the later
prefetches evict the earlier spans and those requests recompute what was read for them (SGLang
counts the tokens as `cache_admission_shortfall`). With the hold (default on) the first spans are
host-locked until their requests run and released then (`/kllm/stats`: every hold admitted, none
left), SGLang counts no shortfall, and every output equals transformers' greedy output.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.hf_reference import hf_greedy
from kllm_plugins.plugins.kv_tiers.testing import flush, l3_args, wait_stats
from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

PAGE = 16
PREFIX_PAGES = 16
N_REUSE = 6
PREFIXES = [list(range(100 + 300 * i, 100 + 300 * i + PREFIX_PAGES * PAGE)) for i in range(N_REUSE)]
PROMPTS = [p + list(range(50 + i, 66 + i)) for i, p in enumerate(PREFIXES)]  # one new page each
LONG = list(range(2000, 2600))  # fills most of L1 while it decodes
ARGS = ["--page-size", str(PAGE), "--dtype", "float32", "--enable-metrics", "--schedule-policy", "fcfs",
        "--hicache-storage-prefetch-policy", "wait_complete"]
ENV = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls",
       "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0",  # every hit is fetched: the hold is under test
       "KLLM_KV_TIERS_REUSE_WINDOW": "0"}  # every page is written to L3 at once


def _shortfall(server: SGLangServer) -> float:
    text = urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:storage_prefetch_unfulfilled_tokens_total")
               and 'reason="cache_admission_shortfall"' in line)


def _scene(tmp_path: Any, hold: bool) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    """Run the scene on a fresh server; the six reuse requests' results, SGLang's shortfall
    tokens and the plugin's last snapshot."""
    env = {**ENV, "KLLM_KV_TIERS_STORE_DIR": str(tmp_path / ("hold" if hold else "nohold")),
           "KLLM_KV_TIERS_ADMISSION_HOLD": "1" if hold else "0"}
    server = SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=ARGS + l3_args("kllm_file"),
                          env=env, max_total_tokens=1024, startup_timeout_s=300)
    server.start()
    try:
        for p in PREFIXES:  # each prefix into L3 (written through L2)
            server.generate(input_ids=p, max_new_tokens=1)
        # pages reach L3 after their requests were admitted: this snapshot counts those admissions
        warm = wait_stats(server, lambda s: s.get("pages_admitted", 0) >= N_REUSE * PREFIX_PAGES, 120.0)
        assert warm.get("pages_admitted", 0) >= N_REUSE * PREFIX_PAGES, warm
        flush(server.base_url)  # L1 and L2 emptied: the prefixes are in L3 only
        before = _shortfall(server)

        results: list[Any] = [None] * N_REUSE
        decoding = r"Decode batch, #running-req: 1"
        seen = len(server.grep_log(decoding))
        long = threading.Thread(target=server.generate,
                                kwargs={"input_ids": LONG, "max_new_tokens": 300, "ignore_eos": True})
        long.start()
        deadline = time.monotonic() + 300
        while len(server.grep_log(decoding)) <= seen and time.monotonic() < deadline:
            time.sleep(0.05)  # the long request is decoding: the reuse requests will queue

        def send(i: int) -> None:
            results[i] = server.generate(input_ids=PROMPTS[i], max_new_tokens=4)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(N_REUSE)]
        for i, th in enumerate(threads):
            th.start()
            time.sleep(0.05)  # in order: the queue is first come, first served
        for th in [long, *threads]:
            th.join(timeout=600)
        # the snapshot is published every 0.5 s by a thread that a loaded machine can delay: wait
        # for one that counts all seven admissions (the long request and the six reuse requests)
        # and, with the hold on, no hold left; the assertions then read a settled state
        admitted = warm.get("requests_admitted", 0) + 1 + N_REUSE
        snap = wait_stats(server, lambda s: s.get("requests_admitted", 0) >= admitted
                          and s.get("admission_holds", {}).get("held_now", 0) == 0, 120.0)
        assert snap.get("requests_admitted", 0) >= admitted, snap
        return results, _shortfall(server) - before, snap
    finally:
        server.stop()


def test_spans_loaded_for_queued_requests_are_kept_until_they_run(tmp_path) -> None:
    refs = hf_greedy(tiny_llama_path(), PROMPTS, 4)
    results, shortfall, snap = _scene(tmp_path, hold=True)
    assert [r["output_ids"] for r in results] == refs
    holds = snap["admission_holds"]
    assert holds["held"] >= 2, holds  # spans did wait for their requests, locked
    assert holds["admitted"] == holds["held"] and holds["held_now"] == 0 and holds["expired"] == 0, holds
    assert holds.get("held_but_short", 0) == 0, holds
    # the gate counts spans in flight with the held ones, so no span lands past the hold's budget
    assert holds.get("over_budget", 0) == 0, holds
    assert shortfall == 0, (f"{shortfall} L3-loaded tokens were evicted before admission with the hold on; "
                            f"holds {json.dumps(holds)}; cached {[r['meta_info']['cached_tokens'] for r in results]}")
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    full = sum(c >= PREFIX_PAGES * PAGE for c in cached)
    assert full >= holds["held"], (cached, holds)  # every held span was used in full

    # the same scene without the hold: SGLang evicts spans before their requests run
    results_off, shortfall_off, snap_off = _scene(tmp_path, hold=False)
    assert [r["output_ids"] for r in results_off] == refs
    assert "admission_holds" not in snap_off
    cached_off = [r["meta_info"]["cached_tokens"] for r in results_off]
    assert shortfall_off > 0 and sum(c >= PREFIX_PAGES * PAGE for c in cached_off) < full, (cached_off, cached)

