"""End to end: a stalled Mooncake master does not stall serving (kv_tiers' `kllm_mooncake` L3).

One real SGLang server on a test-started `mooncake_master`, HiCache prefetch policy
`wait_complete` (a request waits for its L3 prefetch: the policy under which a stalled store
hurts most; with SGLang's default `timeout` policy a request gives up on its prefetch after about
a second plus a per-page budget). Healthy first: a prompt is written to L3 and, flushed, loaded
back. Then the master is stopped (SIGSTOP: TCP still connects, RPCs get no answer): new prompts
keep completing with transformers' greedy output, each well within 15 s, while one log line and
the `store_slow` fault count say why L3 was skipped. Resumed (SIGCONT): the store is used again
(a log line says so) and a flushed prompt is loaded from L3 once more.

Why 15 s: without bounded store calls each of these requests took 30-32 s on this machine (the
Mooncake client's RPC timeout); with them the first request of the stall waits at most one
`store_timeout_ms` (2 s) and later ones do not wait. 15 s is half the RPC timeout, so the stall
cannot pass unnoticed, and over 5x what a request needs here on two busy cores.
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack
from typing import Any, Callable

import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.hf_reference import hf_greedy
from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats, l3_args, mooncake_available, mooncake_master, wait_stats
from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

PROMPTS = [list(range(40 + 11 * i, 440 + 11 * i)) for i in range(6)]  # 400 tokens: 25 pages of 16
PAGES = 25
CACHED = (PAGES - 1) * 16  # a request computes at least its last token: its last page is not reused
NEW = 6
BOUND_S = 15.0
ARGS = ["--page-size", "16", "--dtype", "float32", "--hicache-storage-prefetch-policy", "wait_complete"]
ENV = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls",
       # the L3 path itself is tested: write every page, and fetch what is found
       "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0", "KLLM_KV_TIERS_MIN_REUSE": "1"}


def _wait(server: SGLangServer, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
    return wait_stats(server, pred, timeout_s)


def _timed(server: SGLangServer, prompt: list[int]) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    out = server.generate(input_ids=prompt, max_new_tokens=NEW)
    return out, time.monotonic() - t0


def test_stalled_master_costs_misses_not_stalls() -> None:
    if not mooncake_available():
        pytest.skip("mooncake not installed (pip mooncake-transfer-engine-non-cuda)")
    ref = hf_greedy(tiny_llama_path(), PROMPTS, NEW)
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_master())
        pid = master["proc"].pid
        server = SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], env=ENV, startup_timeout_s=300,
                              extra_args=ARGS + l3_args("kllm_mooncake", master))
        stack.callback(server.stop)
        server.start()
        # healthy: written to L3, then (flushed) loaded from it
        out, _ = _timed(server, PROMPTS[0])
        assert out["output_ids"] == ref[0]
        snap = _wait(server, lambda s: s["store"]["puts"] >= PAGES)
        assert snap["store"]["puts"] >= PAGES, snap
        flush(server.base_url)
        out, _ = _timed(server, PROMPTS[0])
        assert out["output_ids"] == ref[0] and out["meta_info"]["cached_tokens"] >= CACHED, out["meta_info"]

        # deltas from here: a loaded machine may have made an earlier call late, too
        slow0 = kv_tiers_stats(server)["store"]["faults"].get("store_slow", 0)
        lines0 = len(server.grep_log("kv_tiers mooncake store slow"))
        back0 = len(server.grep_log("kv_tiers mooncake store back"))
        os.killpg(pid, signal.SIGSTOP)
        stack.callback(os.killpg, pid, signal.SIGCONT)  # never leave it stopped
        took = []
        for i in (1, 2, 3):  # new prompts: L3 lookups (and writes) against the stalled master
            out, dt = _timed(server, PROMPTS[i])
            took.append(dt)
            assert out["output_ids"] == ref[i] and out["meta_info"]["cached_tokens"] == 0
        assert max(took) < BOUND_S, took
        print(f"requests during the stall took {[round(t, 2) for t in took]} s")  # shown with -s
        snap = _wait(server, lambda s: s["store"]["faults"].get("store_slow", 0) > slow0)
        assert snap["store"]["faults"].get("store_slow", 0) > slow0, snap
        assert len(server.grep_log("kv_tiers mooncake store slow")) == lines0 + 1  # one line per episode

        os.killpg(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        for k in range(1000):  # until a lookup (of a flushed prompt) is answered in time
            if len(server.grep_log("kv_tiers mooncake store back")) > back0:
                break
            assert time.monotonic() < deadline, server.log_tail(20)
            flush(server.base_url)
            i = 4 + k % 2
            out, dt = _timed(server, PROMPTS[i])
            assert out["output_ids"] == ref[i] and dt < BOUND_S, dt
            time.sleep(0.5)
        flush(server.base_url)
        out, dt = _timed(server, PROMPTS[0])  # written before the stall: loaded from L3 again
        assert out["output_ids"] == ref[0] and out["meta_info"]["cached_tokens"] >= CACHED, out["meta_info"]
