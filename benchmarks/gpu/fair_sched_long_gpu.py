"""GPU row of issue 27's second part: one huge prompt in flight (100K tokens by default) while short
and medium prompts arrive, on SGLang (kllm_cuda, random bf16 model of Llama-3.1-8B's width with
`--layers` hidden layers, CUDA graphs on) at `--chunk` (8192). The workload, its figures and the
ratios are those of the CPU benchmark benchmarks/fair_sched/long_in_flight.py, with GPU sizes:
shorts of `--short-len` tokens (Poisson, `--rate` a second), mediums of `--medium-len` (several
passes each), all greedy.

Setups: stock fcfs, lpm, shortest-prefill-first and hrrn, fair_sched with its defaults, and
`--variant TAG:KEY=V` (e.g. `mp2:max_partial_prefills=2`) as fair_sched/TAG. One server per setup,
all up at once, each warmed up with the run's shapes; seed s runs the setups in order, s+1 in
reverse; the prefix cache is flushed before every run. Outputs are compared with fcfs's per seed
(bf16: batching may change a greedy token, so this is informative here; the CPU row checks float32).

    python benchmarks/gpu/fair_sched_long_gpu.py --seeds 2 --variant mp2:max_partial_prefills=2 --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fair_sched"))
from gpu_bench_common import Setup, header, log, write  # noqa: E402
from long_in_flight import (COUNTERS, SETUPS, add_workload_args, parse_variants, print_tables, run_metrics,  # noqa: E402
                            same_outputs, summarize, workload)
from serving import Job, fair_totals, run_jobs  # noqa: E402

GPU_COUNTERS = (*COUNTERS, "long_started", "long_finished", "chunks_cut_for_kv", "chunks_parked_for_kv")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap, long_tokens=100_000, rate=2.0, lead_s=0.5, short=(256, 4096), medium=(8000, 20_000),
                      chunk=8192)
    ap.add_argument("--layers", type=int, default=8, help="hidden layers of the 8B-width model (32: the 8B shape)")
    ap.add_argument("--pool-tokens", type=int, default=140_000)
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        setups = {**{n: SETUPS[n] for n in a.setups}, **parse_variants(a.variant)}
    except (KeyError, ValueError) as exc:
        ap.error(str(exc))
    setup = Setup(a.cpu_dry_run, max_positions=a.long_tokens + 8192, num_hidden_layers=a.layers)
    res = header("benchmarks/gpu/fair_sched_long_gpu.py", "python " + " ".join(sys.argv), setup,
                 {k: v for k, v in vars(a).items() if k not in ("out", "cpu_dry_run")})
    res["setups"] = {n: {"plugins": p, "env": e, "policy": pol} for n, (p, e, pol) in setups.items()}
    res["runs"], res["errors"] = [], []
    from kllm_plugins.testing.sglang_server import flush_cache, start_each

    servers: dict[str, Any] = {}
    for name, (plugins, env, policy) in setups.items():
        extra = ["--chunked-prefill-size", str(a.chunk), "--schedule-policy", policy]
        env = {**env, "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"} if plugins else dict(env)
        if setup.cpu:
            extra += ["--context-length", str(a.long_tokens + 1024)]
            env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        servers[name] = setup.server(plugins, extra, env, a.pool_tokens, a.mem_fraction, graphs=True,
                                     name=f"long-{name.replace('/', '-')}")
    t_start = time.perf_counter()
    try:
        for (name, srv), err in zip(list(servers.items()), start_each(list(servers.values()))):
            if err is not None:
                res["errors"].append({"setup": name, "phase": "start", "error": repr(err)[:500],
                                      "log_tail": srv.log_tail(40)[-4000:]})
                servers.pop(name).stop()
        log("long", f"{len(servers)} servers up in {time.perf_counter() - t_start:.0f} s")
        rng = random.Random(7)
        warm_sizes = (a.short_len[1], a.medium_len[0], a.long_tokens // 4)
        for name in list(servers):  # one by one: every shape's kernels compiled before timing
            try:
                run_jobs(servers[name].base_url, [Job(f"warm{i}", 0.0, [rng.randrange(10, 3900) for _ in range(n)], 4, "warm")
                                                  for i, n in enumerate(warm_sizes)])
            except Exception as exc:  # noqa: BLE001 - a server that dies in warm-up is recorded and left out
                res["errors"].append({"setup": name, "phase": "warm-up", "error": repr(exc)[:500],
                                      "log_tail": servers[name].log_tail(40)[-4000:]})
                servers.pop(name).stop()
        log("long", f"warm-up done at {time.perf_counter() - t_start:.0f} s")
        names = [n for n in setups if n in servers]
        for seed in range(a.seeds):
            done: dict[str, Any] = {}
            for name in (names if seed % 2 == 0 else names[::-1]):
                srv = servers[name]
                try:
                    flush_cache(srv.base_url)
                    before = fair_totals(srv, GPU_COUNTERS) if setups[name][0] else {}
                    outs = run_jobs(srv.base_url, workload(a, seed))
                    row: dict[str, Any] = {"setup": name, "seed": seed, **run_metrics(outs)}
                    if before:
                        after = fair_totals(srv, (*GPU_COUNTERS, "timing_lag"))
                        row.update({k: after.get(k, 0) - before.get(k, 0) for k in GPU_COUNTERS})
                        row["timing_lag"] = after.get("timing_lag", 0)  # the lag in force, not a count
                    done[name] = outs
                except Exception as exc:  # noqa: BLE001 - a failed setup is a result; the others still run
                    row = {"setup": name, "seed": seed, "error": repr(exc)[-300:],
                           "log_tail": srv.log_tail(30)[-3000:]}
                res["runs"].append(row)
                log("long", f"[{time.perf_counter() - t_start:.0f}s] seed {seed} {name}: " + (row.get("error") or " ".join(
                    f"{k} {row[k]:.3g}" for k in ("short_n", "short_mean", "short_p90", "medium_mean",
                                                   "medium_before_long", "long_ttft", "wall"))))
                ref = done.get("fcfs")
                for r in res["runs"]:
                    if r["seed"] == seed and r["setup"] in done and ref is not None:
                        r["same_as_fcfs"] = same_outputs(done[r["setup"]], ref)
                res["metrics"] = summarize(res["runs"], names)
                write(a.out, res)
        print_tables(res["metrics"])
    finally:
        for srv in servers.values():
            srv.stop()
        res["wall_s"] = time.perf_counter() - t_start
        write(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
