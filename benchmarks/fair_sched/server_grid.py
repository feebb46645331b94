"""Benchmark (not collected by pytest): the fair_sched grid on real CPU SGLang servers, on the trace
family of `traces.py`. Stock fcfs, lpm, shortest-prefill-first and hrrn against fair_sched (plugin
defaults), one server each, all started up front and reused; seed s runs the policies in order,
seed s+1 in reverse (ABBA), both loads back to back per policy.

Capacity: after a warm-up, a burst of `--cal-requests` requests of the trace (their own seed) is
submitted at once to the fcfs server; capacity = requests / wall. Loads are fractions of it.
Prints the seed means of each policy and fair_sched's ratio to every stock policy side by side,
checks the issue's targets on seed means, and checks that every request's output is identical
to fcfs's. Records a small summary to `benchmarks/results/fair_sched/server_<trace>_<chunk>.json`.

    flock /tmp/kllm-bench.lock .venv/bin/python benchmarks/fair_sched/server_grid.py --trace bursty --requests 120 --seeds 2

`--pd` runs the same grid with prefill and decode disaggregated (SGLang's `--disaggregation-mode`,
Mooncake over TCP): each policy orders its own prefill server, and one decode server, shared by
all, streams every request (`server_pd_<trace>_<chunk>.json`). A prefill server never decodes, so
the order of prefills reaches TPOT only through the decode batch.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import targets  # noqa: E402
import traces as tr  # noqa: E402
from bench_fair_sched import counters, flush_cache, start_pd_servers, start_servers, warm_up  # noqa: E402
from serving import Job, Outcome, parse_variant, run_jobs  # noqa: E402

from kllm_plugins.bench.progress import Progress  # noqa: E402
from kllm_plugins.bench.record import build_summary, result_path, write_summary  # noqa: E402
from kllm_plugins.bench.stats import quantile  # noqa: E402

POLICIES = ("fcfs", "lpm", "shortest-prefill-first", "hrrn", "fair_sched")
METRICS = ("mean", "p90", "p99", "short_p90", "long_mean", "tpot", "throughput", "retract_logs", "e2e", "decode")
# what SGLang's log says when a scheduler dies (its chunk overcommit ends in "Out of memory")
SERVER_DEATH = r"Out of memory|Try to allocate|Available full tokens|Scheduler hit an exception"
# SGLang's log line when decode finds the KV pool full and sends running requests back to the queue
RETRACT_LOG = r"KV cache pool is full\. Retract requests"


def jobs_for(trace: str, n: int, rate: float, seed: int, long_tokens: int, salt: str) -> list[Job]:
    reqs = tr.make(trace, "cpu", n, seed)
    return [Job(f"{salt}-{trace}-s{seed}-r{i}", (r.arrival_s / rate) if rate > 0 else 0.0, tr.prompt_ids(r, salt=salt),
                r.output_len, "long" if r.input_len > long_tokens else "short") for i, r in enumerate(reqs)]


def run_summary(outs: list[Outcome], wall_s: float) -> dict[str, float]:
    ttft = [o.ttft_s for o in outs]
    short = [o.ttft_s for o in outs if o.kind == "short"]
    long_ = [o.ttft_s for o in outs if o.kind == "long"]
    tpot = [o.tpot_s for o in outs if o.output_len > 1]
    return {"mean": statistics.fmean(ttft), "p90": quantile(ttft, 0.9), "p99": quantile(ttft, 0.99),
            "short_p90": quantile(short, 0.9) if short else float("nan"),
            "long_mean": statistics.fmean(long_) if long_ else float("nan"),
            "tpot": statistics.fmean(tpot), "throughput": len(outs) / wall_s,
            # end to end (arrival to last token) and its decode part, means: where a TTFT saving went
            "e2e": statistics.fmean(o.latency_s for o in outs),
            "decode": statistics.fmean(o.latency_s - o.ttft_s for o in outs)}

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", choices=tr.TRACES, required=True)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.85])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--cal-requests", type=int, default=40)
    ap.add_argument("--fair-env", nargs="*", default=[], help="KLLM_FAIR_SCHED_*=value for the fair_sched server")
    ap.add_argument("--variant", action="append", default=[], metavar="TAG:KEY=V[,KEY=V]",
                    help="also run fair_sched with these KLLM_FAIR_SCHED_* options as policy fair_sched/TAG "
                         "(an ablation beside the defaults; not in the targets)")
    ap.add_argument("--pd", action="store_true",
                    help="prefill/decode disaggregation: each policy orders a prefill server, one decode server serves them all")
    ap.add_argument("--threads", type=int, default=1, help="--pd: torch threads per server process")
    ap.add_argument("--shared", default="shared 2-core, several helpers", help="what shares the machine")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    try:
        args.variants = dict(map(parse_variant, args.variant))
    except ValueError as exc:
        ap.error(str(exc))
    args.policies = list(args.policies) + [p for p in args.variants if p not in args.policies]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the ExitStack: servers stop
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    long_tokens = 8 * tr.SCALES["cpu"].chunk
    t_start = time.time()
    per: dict[tuple[float, str], list[dict[str, float]]] = {}
    outputs: dict[tuple[float, int, str], dict[str, list[int]]] = {}
    fair_counters: dict[str, float] = {}
    seen_retracts: dict[str, int] = {}
    exited: dict[str, dict[str, Any]] = {}
    """Policies whose server died mid-run (SGLang's own errors, e.g. its chunk overcommit): left out."""
    with ExitStack() as stack:
        decode, boot = None, {}
        if args.pd:
            servers, decode, boot = start_pd_servers(stack, args.policies, args, str(tiny_llama_path()))
        else:
            servers = start_servers(stack, args.policies, args, str(tiny_llama_path()))
        # where a policy's requests go: its server, or (--pd) the decode server with its prefill server's bootstrap
        url = {p: (decode or srv).base_url for p, srv in servers.items()}
        for name in servers:
            warm_up(url[name], name, boot.get(name))
        burst = jobs_for(args.trace, args.cal_requests, 0.0, 999, long_tokens, "cal")
        t0 = time.perf_counter()
        run_jobs(url["fcfs"], burst, boot.get("fcfs"))
        capacity = args.cal_requests / (time.perf_counter() - t0)
        print(f"capacity {capacity:.3f} req/s ({args.trace}, burst of {args.cal_requests})", flush=True)
        bar = Progress(args.seeds * len(args.policies) * len(args.loads), f"{args.trace} grid")
        for seed in range(args.seeds):
            order = list(args.policies) if seed % 2 == 0 else list(reversed(args.policies))
            for policy in [p for p in order if p not in exited]:
                srv = servers[policy]
                for load in args.loads:
                    jobs = jobs_for(args.trace, args.requests, load * capacity, seed, long_tokens, f"l{load}")
                    for s in (srv, decode) if decode else (srv,):
                        flush_cache(s)
                    before = counters(srv) if policy == "fair_sched" else {}
                    t0 = time.perf_counter()
                    try:
                        outs = run_jobs(url[policy], jobs, boot.get(policy))
                    except Exception as exc:  # noqa: BLE001 - a server that dies is recorded and left out
                        exited[policy] = {"seed": seed, "load": load, "error": repr(exc)[:300],
                                          "server_log": [ln[:300] for s in (srv, decode) if s for ln in s.grep_log(SERVER_DEATH)][:6]}
                        print(f"[{time.time() - t_start:5.0f}s] {policy}@{load}/s{seed}: FAILED {exc!r}; left out: "
                              f"{exited[policy]['server_log']}", flush=True)
                        break
                    row = run_summary(outs, time.perf_counter() - t0)
                    log_of = "decode" if decode else policy  # the server that decodes this policy's requests
                    retracts = len((decode or srv).grep_log(RETRACT_LOG))  # cumulative in the server's log
                    row["retract_logs"] = float(retracts - seen_retracts.get(log_of, 0))
                    seen_retracts[log_of] = retracts
                    per.setdefault((load, policy), []).append(row)
                    outputs[(load, seed, policy)] = {o.rid: o.output_ids for o in outs}
                    if before:
                        after = counters(srv)
                        for k, v in after.items():
                            fair_counters[k] = fair_counters.get(k, 0) + v - before.get(k, 0)
                    print(f"[{time.time() - t_start:5.0f}s] {policy}@{load}/s{seed}: " +
                          " ".join(f"{k}={v:.3f}" for k, v in row.items()) + f" loadavg={os.getloadavg()[0]:.1f}", flush=True)
                    bar.step(f"{policy}@{load}/s{seed}")
    if "fcfs" in exited or "fair_sched" in exited:
        raise SystemExit(f"the fcfs or fair_sched server exited, nothing to compare: {exited}")
    args.policies = [p for p in args.policies if p not in exited]  # compared on the same seeds only
    cells: dict[str, Any] = {}
    lines = []
    for load in args.loads:
        m = {p: {k: statistics.fmean(x[k] for x in per[(load, p)]) for k in METRICS} for p in args.policies}
        spread = {p: {k: [min(x[k] for x in per[(load, p)]), max(x[k] for x in per[(load, p)])] for k in METRICS}
                  for p in args.policies}
        ratios = {base: {k: m["fair_sched"][k] / m[base][k] if m[base][k] else None for k in METRICS}
                  for base in args.policies if base != "fair_sched"}
        ident = {p: sum(outputs[(load, s, p)][rid] == outputs[(load, s, "fcfs")].get(rid)
                        for s in range(args.seeds) for rid in outputs[(load, s, p)]) /
                 sum(len(outputs[(load, s, p)]) for s in range(args.seeds)) for p in args.policies if p != "fcfs"}
        tg = targets.check(m)
        cells[str(load)] = {"rate_req_s": load * capacity, "seed_mean": m, "min_max_over_seeds": spread,
                            "fair_sched_ratio_to": ratios, "outputs_identical_to_fcfs": ident, "targets": tg}
        lines.append(f"{args.trace} @ {load} ({load * capacity:.3f} req/s), seed means over {args.seeds} seeds; "
                     f"fair_sched / policy in brackets")
        lines.append(f"  {'metric':11s}" + "".join(f"{p:>28s}" for p in args.policies))
        def cell_text(p: str, k: str) -> str:
            r = ratios[p][k] if p != "fair_sched" else None
            return f"{m[p][k]:.3f}" + (f" [{r:.2f}x]" if r is not None else "")

        for k in METRICS:
            lines.append(f"  {k:11s}" + "".join(f"{cell_text(p, k):>28s}" for p in args.policies))
        lines.append("  targets: " + "; ".join(f"{k} {v['value']:.2f} {'ok' if v['met'] else 'MISS'}" for k, v in tg.items()))
        lines.append("  outputs identical to fcfs: " + ", ".join(f"{p} {v:.0%}" for p, v in ident.items()))
    print("\n".join(lines), flush=True)
    command = "flock /tmp/kllm-bench.lock python " + " ".join(sys.argv)
    met = sum(all(v["met"] for v in c["targets"].values()) for c in cells.values())
    summary = build_summary(command, {"cells": cells, "cells_meeting_every_target": f"{met}/{len(cells)}",
                                      "fair_sched_counters": fair_counters, "servers_exited": exited},
                            shared=args.shared, trace=args.trace, chunk=args.chunk, requests_per_run=args.requests,
                            seeds=args.seeds, capacity_req_s=capacity, long_prompt_over_tokens=long_tokens,
                            fair_env=args.fair_env, wall_s=round(time.time() - t_start),
                            pd={"threads_per_server": args.threads} if args.pd else None,
                            notes="real CPU SGLang servers (kllm_cpu), tiny model float32, greedy; policies interleaved "
                                  "per seed (ABBA); ratios on seed means" +
                                  ("; prefill/decode disaggregated: the policy orders a prefill server, one decode "
                                   "server (Mooncake over TCP) serves every policy" if args.pd else ""))
    path = args.out or str(result_path("fair_sched", f"server_{'pd_' if args.pd else ''}{args.trace}_{args.chunk}"))
    write_summary(path, summary)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
