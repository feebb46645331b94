"""fair_sched end to end on real CPU SGLang servers (tiny model): identical outputs with and without
the plugin while its policy is exercised, the watermark gate pausing and resuming admission
under a burst, a forced repetition loop cut with its finish reason, and a bad option refused."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fair_sched"))


LONG = 2500


def _jobs() -> list[Any]:
    from serving import Job

    rng = random.Random(7)
    # The long prompt (39 chunks of 64) takes longer to prefill than the shorts take to arrive,
    # even on an idle machine, so shorts arrive while it is being prefilled.
    jobs = [Job("long", 0.0, [rng.randrange(5, 4090) for _ in range(LONG)], 8, "long")]
    for i in range(6):
        n = rng.randint(20, 60)
        jobs.append(Job(f"short{i}", 0.05 + 0.1 * i, [rng.randrange(5, 4090) for _ in range(n)], 8, "short"))
    return jobs


def _tiny_fcfs(chunk: int, seed: int, *extra: str) -> tuple[str, list[str], random.Random, Callable[[int], list[int]]]:
    """The tiny model, a stock fcfs server's arguments at `chunk` (float32: outputs compare
    token for token), a seeded generator and prompt ids drawn from it."""
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    rng = random.Random(seed)
    args = ["--chunked-prefill-size", str(chunk), "--schedule-policy", "fcfs", "--dtype", "float32", *extra]
    return str(tiny_llama_path()), args, rng, lambda n: [rng.randrange(5, 4090) for _ in range(n)]


def _stats(server: Any) -> dict[str, Any]:
    return server.get_json("/kllm/stats")["fair_sched"]["total"]


def _wait_stats(server: Any, key: str, at_least: int, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = _stats(server)
        if snap.get(key, 0) >= at_least or time.monotonic() > deadline:
            return snap
        time.sleep(0.3)


def _stock_outputs(model: str, args: list[str], jobs: list[Any]) -> dict[str, Any]:
    """The same jobs on a stock server (fcfs): the reference outputs, by request id."""
    from serving import run_jobs, sglang_server

    with sglang_server(model, extra_args=args) as stock:
        return {o.rid: o for o in run_jobs(stock.base_url, jobs)}


def _same_outputs(fair: Any, jobs: list[Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Run the jobs on `fair`; every request's tokens equal the reference's."""
    from serving import run_jobs

    got = {o.rid: o for o in run_jobs(fair.base_url, jobs)}
    for rid, o in ref.items():
        assert got[rid].output_ids == o.output_ids, rid
    return got


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
        # Every hook attached: fair_sched's 9 plus the platform's own (the count varies with the platform).
        applied = fair.grep_log(r"plugins=\[fair_sched\], hooks applied (\d+)/\1\b")
        assert applied and all(int(re.search(r"applied (\d+)/", line).group(1)) >= 9 for line in applied)
        got = {o.rid: o for o in run_jobs(fair.base_url, jobs)}
        # 1. Same tokens for every request, with the policy really in play.
        for rid, o in ref.items():
            assert got[rid].output_ids == o.output_ids, rid
            assert len(o.output_ids) == 8
        snap = _wait_stats(fair, "long_finished", 1)
        assert snap["long_started"] >= 1 and snap["long_finished"] >= 1
        assert snap["long_chunks"] >= LONG // 64
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

        # 2b. A router reads the same state from SGLang's own load endpoint, JSON and Prometheus.
        section = fair.get_json("/v1/loads")["loads"][0]["kllm_fair_sched"]
        assert section["watermark_pauses"] == snap["watermark_pauses"] and section["admission_paused"] in (0, 1)
        assert section["kv_high_watermark"] == 0.2 and section["long_finished"] >= 1 and section["age_s"] >= 0
        assert {"kv_usage", "waiting_long_reqs", "active_long_quota_tokens", "base_quota_tokens"} <= set(section)
        assert "kllm_fair_sched" not in fair.get_json("/v1/loads?include=core")["loads"][0]
        with urllib.request.urlopen(f"{fair.base_url}/v1/loads?format=prometheus", timeout=10) as resp:
            prom = resp.read().decode()
        assert re.search(r'^sglang_kllm_fair_sched_admission_paused\{dp_rank="0"\} [01]$', prom, re.M)
        assert re.search(r'^sglang_kllm_fair_sched_watermark_pauses\{dp_rank="0"\} [1-9]', prom, re.M)

        # 3. A request forced into a loop (one token favoured by a huge logit bias) is cut.
        loop = fair.post_json("/generate", {
            "input_ids": list(range(100, 140)),
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                "logit_bias": {"77": 100.0}},
        })
        reason = loop["meta_info"]["finish_reason"]
        assert reason["reason"] == "repetition_loop" and reason["period"] == 1 and reason["retracts"] == 0
        assert len(loop["output_ids"]) == 24
        snap = _wait_stats(fair, "loops_cut", 1)
        assert snap["loops_cut"] == 1
        # Its KV is released: after one more request, usage (excluding evictable cache) is back to ~0.
        fair.generate(input_ids=list(range(300, 310)), max_new_tokens=2)
        time.sleep(0.5)
        assert _stats(fair)["kv_usage"] < 0.01


def test_loop_retract_requeues_then_finishes() -> None:
    """loop_action=retract: the looping request is retracted once (KV released, requeued), resumes,
    loops again and is then finished with the loop reason; a request decoding beside it is unaffected."""
    pytest.importorskip("sglang")
    from serving import Job, run_jobs, sglang_server

    from kllm_plugins.models.tiny_llama import tiny_llama_path

    env = {
        "KLLM_FAIR_SCHED_LOOP_MIN_TOKENS": "24",
        "KLLM_FAIR_SCHED_LOOP_MAX_PERIOD": "4",
        "KLLM_FAIR_SCHED_LOOP_ACTION": "retract",
        "KLLM_FAIR_SCHED_LOOP_MAX_RETRACTS": "1",
        "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1",
    }
    args = ["--chunked-prefill-size", "64", "--dtype", "float32"]
    normal = [Job("normal", 0.0, list(range(500, 530)), 60, "short")]
    with sglang_server(str(tiny_llama_path()), plugins=["fair_sched"], extra_args=args, env=env) as fair:
        [ref] = run_jobs(fair.base_url, normal)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(fair.post_json, "/generate", {
                "input_ids": list(range(100, 140)),
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                    "logit_bias": {"77": 100.0}},
            })
            [beside] = run_jobs(fair.base_url, [Job("beside", 0.0, normal[0].input_ids, 60, "short")])
            loop = fut.result()
        reason = loop["meta_info"]["finish_reason"]
        assert reason["reason"] == "repetition_loop" and reason["retracts"] == 1
        # 24 tokens to the first verdict, a step or two until the retraction, then 24 new ones.
        assert 48 <= len(loop["output_ids"]) <= 52 and set(loop["output_ids"]) == {77}
        assert beside.output_ids == ref.output_ids
        snap = _wait_stats(fair, "loops_cut", 1)
        assert snap["loops_retracted"] == 1 and snap["loops_cut"] == 1
        assert snap["loop_retract_freed_tokens"] >= 40 + 24  # prompt + output released at the retraction
        assert fair.grep_log("retracted for a repetition loop")
        fair.generate(input_ids=list(range(300, 310)), max_new_tokens=2)
        time.sleep(0.5)
        assert _stats(fair)["kv_usage"] < 0.01


@pytest.mark.parametrize("flag,value,message", [
    ("--kllm-fair-sched-kv-low-watermark", "0.99", "kv_low_watermark must be in [0, kv_high_watermark=0.95), got 0.99"),
    ("--kllm-fair-sched-loop-action", "explode", "bad value 'explode' for --kllm-fair-sched-loop-action; valid choices: finish, retract"),
])
def test_bad_option_is_a_clear_startup_error(flag: str, value: str, message: str) -> None:
    pytest.importorskip("sglang")
    from serving import entry_point_shim

    from kllm_plugins.models.tiny_llama import tiny_llama_path

    env = dict(os.environ, SGLANG_PLATFORM="kllm_cpu", KLLM_STRICT="1")
    shim = entry_point_shim()
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_llama_path()),
         "--enable-plugin", "fair_sched", f"{flag}={value}", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_several_partial_prefills_let_a_medium_prompt_past_a_long_one() -> None:
    """max_partial_prefills 2: a medium prompt (larger than a whole pass, so it can neither ride nor
    be yielded to) arriving while a long prompt is half prefilled suspends the long one, is
    prefilled and answered first, and the long one resumes where it stopped (nothing recomputed);
    outputs equal stock's. Stock fcfs serves the long prompt first. An abort of a suspended request
    releases it through SGLang's chunked abort, and the server stays healthy."""
    pytest.importorskip("sglang")
    from serving import Job, sglang_server

    model, args, _, ids = _tiny_fcfs(64, 11)
    jobs = [Job("long", 0.0, ids(4000), 4, "long"), Job("medium", 0.15, ids(400), 4, "short"),
            Job("short", 0.2, ids(40), 4, "short")]
    ref = _stock_outputs(model, args, jobs)
    # stock: the medium waits for the whole long prefill
    assert ref["medium"].arrival_s + ref["medium"].ttft_s > ref["long"].ttft_s

    env = {"KLLM_FAIR_SCHED_MAX_PARTIAL_PREFILLS": "2", "KLLM_FAIR_SCHED_LONG_PARTIAL_TOKENS": "100000",
           "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"}
    with sglang_server(model, plugins=["fair_sched"], extra_args=args, env=env) as fair:
        got = _same_outputs(fair, jobs, ref)
        assert got["medium"].arrival_s + got["medium"].ttft_s < got["long"].ttft_s
        snap = _wait_stats(fair, "partials_resumed", 1)
        # yields_to_partial counts the suspensions
        assert snap["yields_to_partial"] >= 1 and snap["partials_resumed"] >= 1
        assert snap["recomputed_tokens"] == 0 and snap["suspended_partials"] == 0

        # Abort the long prompt while it is suspended behind a 1,500-token one.
        with ThreadPoolExecutor(2) as pool:
            long_f = pool.submit(fair.post_json, "/generate", {
                "rid": "long2", "input_ids": ids(6000),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, 300)
            time.sleep(0.15)
            medium_f = pool.submit(fair.post_json, "/generate", {
                "rid": "medium2", "input_ids": ids(1500),
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, 300)
            deadline = time.monotonic() + 20
            while _stats(fair).get("suspended_partials", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _stats(fair).get("suspended_partials", 0) == 1
            req = urllib.request.Request(f"{fair.base_url}/abort_request", data=b'{"rid": "long2"}',
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
            long_out, medium_out = long_f.result(), medium_f.result()
        assert long_out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(medium_out["output_ids"]) == 4
        snap = _wait_stats(fair, "partials_aborted", 1)
        assert snap["partials_aborted"] == 1 and snap["suspended_partials"] == 0
        assert len(fair.generate(input_ids=ids(30), max_new_tokens=3)["output_ids"]) == 3
        time.sleep(1.0)
        assert _stats(fair)["kv_usage"] < 0.01
        assert not fair.grep_log(r"memory leak|Scheduler hit an exception|Traceback")


def test_decode_time_share_decodes_several_steps_in_a_row_while_a_long_prompt_prefills() -> None:
    """decode_time_share 0.5: short requests that decode while a long prompt prefills get decode
    steps several in a row (a decode step of the tiny model is shorter than a prefill pass), which
    decode_share can never give (one per prefill pass at most); outputs equal stock's."""
    pytest.importorskip("sglang")
    from serving import Job, sglang_server

    model, args, _, ids = _tiny_fcfs(64, 5)
    jobs = [Job("long", 0.0, ids(4000), 4, "long"),
            *(Job(f"short{i}", 0.05 + 0.05 * i, ids(40), 24, "short") for i in range(4))]
    ref = _stock_outputs(model, args, jobs)
    env = {"KLLM_FAIR_SCHED_DECODE_SHARE": "0", "KLLM_FAIR_SCHED_DECODE_TIME_SHARE": "0.5",
           "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"}
    with sglang_server(model, plugins=["fair_sched"], extra_args=args, env=env) as fair:
        got = _same_outputs(fair, jobs, ref)
        # the shorts rode beside the long prefill and decoded before it ended
        assert all(got[f"short{i}"].arrival_s + got[f"short{i}"].ttft_s < got["long"].ttft_s for i in range(4))
        snap = _wait_stats(fair, "long_finished", 1)
        assert snap["decode_run_max"] >= 2, snap
        # a CPU pass ends inside its launch: the time between plans is the pass just planned
        assert snap["timing_lag"] == 0 and snap["decode_step_ms"] > 0, snap
        # the time of both kinds of pass while prompts waited is reported
        assert snap["waiting_prefill_s"] > 0 and snap["waiting_decode_s"] > 0, snap
        assert snap["yields_to_decode"] >= 2 and snap["recomputed_tokens"] == 0
        assert not fair.grep_log(r"Scheduler hit an exception|Traceback")


def test_rounds_sglang_decodes_under_prefill_decode_interval_are_seen_as_decode_steps() -> None:
    """SGLang's --prefill-decode-interval 1 decodes once after each prefill pass without reaching
    fair_sched's pass planner: fair_sched counts and times those rounds as decode steps, so its
    decode_share adds none of its own while the long prompt prefills; outputs equal stock's."""
    pytest.importorskip("sglang")
    from serving import Job, sglang_server

    model, args, _, ids = _tiny_fcfs(64, 11, "--prefill-decode-interval", "1")
    jobs = [Job("long", 0.0, ids(2000), 4, "long"),
            *(Job(f"short{i}", 0.05 + 0.05 * i, ids(40), 16, "short") for i in range(3))]
    ref = _stock_outputs(model, args, jobs)
    env = {"KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"}
    with sglang_server(model, plugins=["fair_sched"], extra_args=args, env=env) as fair:
        _same_outputs(fair, jobs, ref)
        snap = _wait_stats(fair, "long_finished", 1)
        assert snap["interval_decode_rounds"] >= 5, snap
        assert snap["yields_to_decode"] == 0 and snap["decode_step_ms"] > 0, snap
        assert not fair.grep_log(r"Scheduler hit an exception|Traceback")


def test_requests_that_end_at_their_first_token_get_no_decode_steps() -> None:
    """Requests with max_new_tokens 1 (the prefill side of a disaggregated pair, scoring calls)
    sit in SGLang's running batch until their prefill's result is processed, but never decode:
    fair_sched plans no decode step for them while prompts wait; outputs equal stock's."""
    pytest.importorskip("sglang")
    from serving import Job, sglang_server

    model, args, rng, ids = _tiny_fcfs(128, 3)
    jobs = [Job("long", 0.0, ids(2000), 1, "long"),
            *(Job(f"short{i}", 0.05 * i, ids(rng.randint(30, 300)), 1, "short") for i in range(20))]
    ref = _stock_outputs(model, args, jobs)
    env = {"KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"}
    with sglang_server(model, plugins=["fair_sched"], extra_args=args, env=env) as fair:
        before = _stats(fair)  # the server's warm-up request decodes
        _same_outputs(fair, jobs, ref)
        snap = _wait_stats(fair, "long_finished", before["long_finished"] + 1)
        assert snap["passes"] > before["passes"] + 10, snap
        assert snap["yields_to_decode"] == before["yields_to_decode"], (before, snap)
        assert not fair.grep_log(r"Scheduler hit an exception|Traceback")
