"""fair_sched end to end on real CPU SGLang servers (tiny model): identical outputs with and without
the plugin while its policy is exercised, the watermark gate pausing and resuming admission
under a burst, a forced repetition loop cut with its finish reason, and a bad option refused."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fair_sched"))


def _jobs() -> list[Any]:
    from serving import Job

    rng = random.Random(7)
    jobs = [Job("long", 0.0, [rng.randrange(5, 4090) for _ in range(700)], 8, "long")]
    for i in range(6):
        n = rng.randint(20, 60)
        jobs.append(Job(f"short{i}", 0.2 + 0.25 * i, [rng.randrange(5, 4090) for _ in range(n)], 8, "short"))
    return jobs


def _stats(server: Any) -> dict[str, Any]:
    return server.get_json("/kllm/stats")["fair_sched"]["total"]


def _wait_stats(server: Any, key: str, at_least: int, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = _stats(server)
        if snap.get(key, 0) >= at_least or time.monotonic() > deadline:
            return snap
        time.sleep(0.3)


def test_fair_sched_end_to_end() -> None:
    pytest.importorskip("sglang")
    from serving import Job, run_jobs, sglang_server

    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    # float32: bf16 rounding depends on batch composition, which the policy changes by design,
    # and flips near-tied argmaxes of the random tiny model; float32 compares the tokens.
    args = ["--chunked-prefill-size", "64", "--schedule-policy", "fcfs", "--dtype", "float32"]
    jobs = _jobs()
    with sglang_server(model, extra_args=args) as stock:
        ref = {o.rid: o for o in run_jobs(stock.base_url, jobs)}

    env = {
        # A gate low enough that the burst below crosses it (max_total_tokens is 16384).
        "KLLM_FAIR_SCHED_KV_HIGH_WATERMARK": "0.2",
        "KLLM_FAIR_SCHED_KV_LOW_WATERMARK": "0.05",
        "KLLM_FAIR_SCHED_LOOP_MIN_TOKENS": "24",
        "KLLM_FAIR_SCHED_LOOP_MAX_PERIOD": "4",
        "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1",
    }
    with sglang_server(model, plugins=["fair_sched"], extra_args=args, env=env) as fair:
        assert fair.grep_log(r"plugins=\[fair_sched\], hooks applied 7/7")
        got = {o.rid: o for o in run_jobs(fair.base_url, jobs)}
        # 1. Same tokens for every request, with the policy really in play.
        for rid, o in ref.items():
            assert got[rid].output_ids == o.output_ids, rid
            assert len(o.output_ids) == 8
        snap = _wait_stats(fair, "long_finished", 1)
        assert snap["long_started"] >= 1 and snap["long_finished"] >= 1
        assert snap["long_chunks"] >= 700 // 64
        assert snap["shorts_beside_long"] + snap["yields_to_short"] + snap["yields_to_decode"] >= 1
        assert snap["recomputed_tokens"] == 0

        # 2. Burst: 12 x 600 prompt tokens + 48 outputs exceed 20% of 16384 KV tokens.
        rng = random.Random(3)
        burst = [Job(f"burst{i}", 0.0, [rng.randrange(5, 4090) for _ in range(600)], 48, "short") for i in range(12)]
        outs = run_jobs(fair.base_url, burst)
        assert all(len(o.output_ids) == 48 for o in outs)
        snap = _wait_stats(fair, "watermark_resumes", 1)
        assert snap["watermark_pauses"] >= 1 and snap["watermark_resumes"] >= 1
        assert snap["watermark_blocked_passes"] >= 1
        assert fair.grep_log("admission paused") and fair.grep_log("admission resumed")

        # 3. A request forced into a loop (one token favoured by a huge logit bias) is cut.
        loop = fair.post_json("/generate", {
            "input_ids": list(range(100, 140)),
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                "logit_bias": {"77": 100.0}},
        })
        reason = loop["meta_info"]["finish_reason"]
        assert reason["reason"] == "repetition_loop" and reason["period"] == 1
        assert len(loop["output_ids"]) == 24
        snap = _wait_stats(fair, "loops_cut", 1)
        assert snap["loops_cut"] == 1
        # Its KV is released: after one more request, usage (excluding evictable cache) is back to ~0.
        fair.generate(input_ids=list(range(300, 310)), max_new_tokens=2)
        time.sleep(0.5)
        assert _stats(fair)["kv_usage"] < 0.01


def test_bad_option_is_a_clear_startup_error() -> None:
    pytest.importorskip("sglang")
    from serving import entry_point_shim

    from kllm_plugins.models.tiny_llama import tiny_llama_path

    env = dict(os.environ, SGLANG_PLATFORM="kllm_cpu", KLLM_STRICT="1")
    shim = entry_point_shim()
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_llama_path()),
         "--enable-plugin", "fair_sched", "--kllm-fair-sched-kv-low-watermark", "0.99", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "kv_low_watermark must be in [0, kv_high_watermark=0.95), got 0.99" in proc.stderr
