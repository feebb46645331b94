"""Does the server survive a tight KV pool? SGLang 0.5.23's chunk overcommit vs fair_sched's chunk_guard.

Workload (tiny model, CPU platform, `--disable-radix-cache`, so finished requests' KV is freed at
once and nothing is evictable): rounds of one long prompt (`--long-frac` of the KV pool) followed
at once by `--shorts` short prompts of `--short-len` tokens with `--short-out` greedy output
tokens (ignore_eos), the next round `--gap-s` later. Short prompts riding beside the long one's
partial prefill fill the pool; once the pass budget (free KV minus the headroom reserved for the
decoding requests) is spent, SGLang's single-pool PrefillBudget hands the continuing chunk a whole
chunk, and its allocation fails when fewer tokens are free: the scheduler exits and every request
in flight is lost. This happened on the H200 (benchmarks/results/fair_sched/gpu_bursty.json).

Setups, interleaved, `--repeats` times: stock fcfs; fair_sched with `chunk_guard` off; fair_sched
with it on (the default). Per run: requests answered with every token, whether the server survived
(its scheduler alive and no leak reported at idle), and the guard's counters.

    python benchmarks/fair_sched/chunk_guard.py --repeats 3
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kllm_plugins.bench.record import record

SETUPS = {"stock_fcfs": ([], {}), "fair_sched_guard_off": (["fair_sched"], {"KLLM_FAIR_SCHED_CHUNK_GUARD": "0"}),
          "fair_sched_guard_on": (["fair_sched"], {})}


def one_run(name: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    from kllm_plugins.models.tiny_llama import tiny_llama_path
    from kllm_plugins.testing.sglang_server import SGLangServer

    plugins, env = SETUPS[name]
    srv = SGLangServer(str(tiny_llama_path()), plugins=plugins, env=env, max_total_tokens=a.pool, startup_timeout_s=600,
                       extra_args=["--dtype", "float32", "--chunked-prefill-size", str(a.chunk), "--schedule-policy", "fcfs",
                                   "--disable-radix-cache"])
    srv.start()
    rng = random.Random(seed)

    def ask(n: int, out: int) -> bool:
        ids = [rng.randrange(10, 3900) for _ in range(n)]
        try:
            r = srv.post_json("/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": out, "temperature": 0, "ignore_eos": True}}, timeout=300)
            return r["meta_info"]["completion_tokens"] == out
        except Exception:  # noqa: BLE001 - a lost request is what this benchmark counts
            return False

    try:
        jobs = []
        with ThreadPoolExecutor(a.shorts + 2) as pool:
            for _ in range(a.rounds):
                jobs.append(pool.submit(ask, int(a.pool * a.long_frac), 4))
                time.sleep(0.05)
                for _ in range(a.shorts):
                    jobs.append(pool.submit(ask, a.short_len, a.short_out))
                    time.sleep(0.02)
                time.sleep(a.gap_s)
            answered = sum(j.result() for j in jobs)
        time.sleep(3.0)  # SGLang checks its pools for leaks when idle
        crashed = bool(srv.grep_log(r"Scheduler hit an exception"))
        counters: dict[str, Any] = {}
        if not crashed and plugins:
            total = srv.get_json("/kllm/stats").get("fair_sched", {}).get("total", {})
            counters = {k: total.get(k, 0) for k in ("chunks_cut_for_kv", "chunks_parked_for_kv", "second_truncation_refused")}
        cause = srv.grep_log(r"Out of memory|memory leak detected")[:1]
        return {"setup": name, "seed": seed, "requests": len(jobs), "answered": answered, "server_survived": not crashed,
                "cause": cause[0][-160:] if cause else "", **counters}
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--long-frac", type=float, default=0.7)
    ap.add_argument("--shorts", type=int, default=12)
    ap.add_argument("--short-len", type=int, default=100)
    ap.add_argument("--short-out", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=3.0)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS))
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    runs = []
    for rep in range(a.repeats):
        order = a.setups if rep % 2 == 0 else a.setups[::-1]
        for name in order:
            row = one_run(name, a, seed=rep)
            runs.append(row)
            print(f"[chunk_guard] repeat {rep} {name}: answered {row['answered']}/{row['requests']}, survived "
                  f"{row['server_survived']} {row.get('cause', '')[:80]} {dict((k, row[k]) for k in row if k.startswith('chunks_'))}",
                  flush=True)
    metrics: dict[str, Any] = {}
    print(f"{'setup':24} {'survived':>9} {'answered':>10}")
    for name in a.setups:
        rs = [r for r in runs if r["setup"] == name]
        metrics[name] = {"runs": len(rs), "survived": sum(r["server_survived"] for r in rs),
                         "answered_share": sum(r["answered"] for r in rs) / max(1, sum(r["requests"] for r in rs)),
                         "chunks_cut_for_kv": sum(r.get("chunks_cut_for_kv", 0) for r in rs),
                         "chunks_parked_for_kv": sum(r.get("chunks_parked_for_kv", 0) for r in rs)}
        print(f"{name:24} {metrics[name]['survived']:>5}/{len(rs):<3} {metrics[name]['answered_share']:>10.3f}")
    if not a.no_record:
        path = record("fair_sched", "chunk_guard", "python " + " ".join(sys.argv), metrics, runs=runs,
                      settings={k: v for k, v in vars(a).items() if k != "no_record"},
                      machine={"cpu": "shared 2-core, 2 helpers", "platform": "kllm_cpu", "model": "tiny-llama"})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
