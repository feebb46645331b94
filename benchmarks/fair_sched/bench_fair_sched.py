"""Benchmark: stock SGLang policies (fcfs, lpm, shortest-prefill-first) vs fair_sched on the same
traces, on real CPU SGLang servers with the tiny model. Not collected by pytest.

One server per policy, all started up front (idle servers sleep: `--sleep-on-idle`) and reused
for every load and seed; seed s runs the policies in order, seed s+1 in reverse (ABBA), so slow
drift of the machine does not favour the policies that run first.

Capacity is measured at the start on the fcfs server: after a warm-up, `--cal-requests`
requests of the mix (their own seed) are submitted at once and capacity = requests / wall time
(the saturated throughput of the mix). The loads are fractions of it. Solo TTFT of a long prompt
is measured at the mix's shortest and longest long prompt (linear in between) for the ratio
"long TTFT / solo TTFT".

    python benchmarks/fair_sched/bench_fair_sched.py --mix issue --requests 200 --loads 0.6 0.85 --seeds 2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import POLICIES, append_results_md, plot, table, write_json  # noqa: E402
from serving import Job, Prefill, fair_totals, run_jobs, sglang_server  # noqa: E402
from workload import MIXES, Mix, make_trace, summarize  # noqa: E402

from kllm_plugins.testing.sglang_server import PD_CPU_ENV, pd_cpu_args, start_all  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COUNTERS = ("yields_to_short", "yields_to_decode", "limited_passes", "ride_passes", "long_overtakes", "shorts_beside_long", "long_started",
            "long_finished", "long_chunks", "recomputed_tokens", "second_truncation_refused", "waiting_prefill_s",
            "waiting_decode_s")


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 4090) for _ in range(n)]


def cpu_busy(window_s: float = 3.0) -> float:
    """Fraction of the machine's CPU time that was not idle over `window_s`."""
    def read() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]
    t0, i0 = read()
    time.sleep(window_s)
    t1, i1 = read()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_for_quiet(max_s: float, busy_below: float = 0.3) -> float:
    """Wait (at most max_s) until other work has left the CPU; return the last busy fraction."""
    deadline = time.time() + max_s
    busy = cpu_busy()
    while busy >= busy_below and time.time() < deadline:
        busy = cpu_busy()
    return busy


def policy_server(model: str, policy: str, args: Any, env: dict[str, str] | None = None,
                  plugins: Sequence[str] = (), extra_args: Sequence[str] = ()) -> Any:
    """The (unstarted) server that runs `policy`: stock SGLang with `--schedule-policy`, or fcfs with
    the fair_sched plugin (`fair_sched`, or `fair_sched/<tag>` with `args.variants[policy]` on top of
    `args.fair_env`); `env`, `plugins` and `extra_args` are added for every policy."""
    fair = policy == "fair_sched" or policy.startswith("fair_sched/")
    penv = {**(env or {}), **(dict(kv.split("=", 1) for kv in args.fair_env) if fair else {}),
            **getattr(args, "variants", {}).get(policy, {})}
    return sglang_server(model, plugins=["fair_sched", *plugins] if fair else list(plugins),
                         extra_args=["--chunked-prefill-size", str(args.chunk), "--schedule-policy",
                                     "fcfs" if fair else policy, "--dtype", args.dtype, *extra_args],
                         max_total_tokens=args.max_total_tokens, env=penv)


def _start(stack: ExitStack, servers: Sequence[Any]) -> float:
    """Start `servers` together (each stopped when `stack` closes, a TERM during start-up
    included); seconds it took."""
    for srv in servers:
        stack.callback(srv.stop)  # registered first: a TERM during start-up still stops them
    t0 = time.time()
    start_all(servers)
    return time.time() - t0


def start_servers(stack: ExitStack, policies: list[str], args: Any, model: str) -> dict[str, Any]:
    servers = {p: policy_server(model, p, args) for p in policies}
    print(f"{len(servers)} servers up in {_start(stack, list(servers.values())):.0f}s", flush=True)
    return servers


def start_pd_servers(stack: ExitStack, policies: list[str], args: Any, model: str) -> tuple[dict[str, Any], Any, dict[str, Prefill]]:
    """Prefill and decode disaggregated on a CPU (`PD_CPU_ENV`, `pd_cpu_args`): one prefill server
    per policy (`policy_server`) and one decode server they all hand their requests to; each process
    runs `args.threads` torch threads, so a prefill and the decode server do not share a core when
    threads x 2 <= cores. Returns (prefill servers by policy, the decode server, each prefill's
    bootstrap for `run_jobs`)."""
    env = {**PD_CPU_ENV, "OMP_NUM_THREADS": str(args.threads)}
    decode = sglang_server(model, plugins=["bigpd_router"], max_total_tokens=args.max_total_tokens, env=env,
                           extra_args=[*pd_cpu_args("decode"), "--dtype", args.dtype])
    prefills = {p: policy_server(model, p, args, env, ["bigpd_router"], pd_cpu_args("prefill")) for p in policies}
    took = _start(stack, [decode, *prefills.values()])
    print(f"{len(prefills)} prefill servers and a decode server up in {took:.0f}s", flush=True)
    boot = {p: Prefill(srv.base_url, "127.0.0.1", int(srv.get_json("/server_info")["disaggregation_bootstrap_port"]))
            for p, srv in prefills.items()}
    return prefills, decode, boot


def warm_up(url: str, tag: str, pd: Prefill | None = None) -> None:
    rng = random.Random(7)
    run_jobs(url, [Job(f"warm-{tag}-{i}", 0.0, rand_ids(rng, n), 8, "short") for i, n in enumerate((80, 300, 1500, 80))], pd)


def measure(url: str, mix: Mix, n_cal: int) -> dict[str, float]:
    rng = random.Random(999)
    solo: dict[str, float] = {}
    solo["short_ttft_s"] = statistics.median(
        run_jobs(url, [Job(f"cal-s{i}", 0.0, rand_ids(rng, 80), 16, "short")])[0].ttft_s for i in range(3))
    for name, n in (("lo", mix.long_min), ("hi", mix.long_max)):
        solo[f"long_{name}_tokens"] = float(n)
        solo[f"long_{name}_ttft_s"] = run_jobs(url, [Job(f"cal-l{name}", 0.0, rand_ids(rng, n), 16, "long")])[0].ttft_s
    if n_cal <= 0:
        return solo
    burst = make_trace(mix, n_cal, 0.0, 999, prefix="cal-")
    t0 = time.perf_counter()
    run_jobs(url, burst)
    wall = time.perf_counter() - t0
    solo["capacity_req_s"] = n_cal / wall
    solo["capacity_burst_requests"] = float(n_cal)
    solo["capacity_burst_wall_s"] = wall
    return solo


def solo_fn(cal: dict[str, float]) -> Any:
    lo, hi = cal["long_lo_tokens"], cal["long_hi_tokens"]
    tlo, thi = cal["long_lo_ttft_s"], cal["long_hi_ttft_s"]
    slope = (thi - tlo) / (hi - lo) if hi > lo else 0.0
    return lambda n: max(tlo + slope * (n - lo), 1e-3)


def flush_cache(srv: Any) -> None:
    """Every run starts with an empty prefix cache: the two loads of a seed replay the same prompts."""
    import urllib.request

    for _ in range(20):
        try:
            with urllib.request.urlopen(urllib.request.Request(srv.base_url + "/flush_cache", method="POST"), timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"could not flush the prefix cache of {srv.base_url}")


def counters(srv: Any) -> dict[str, float]:
    return fair_totals(srv, COUNTERS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", choices=sorted(MIXES), default="issue")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.85])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32: outputs comparable token for token across policies")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--cal-requests", type=int, default=60)
    ap.add_argument("--capacity", type=float, default=0.0, help="req/s; skips the capacity burst (smoke runs)")
    ap.add_argument("--fair-env", nargs="*", default=[], help="KLLM_FAIR_SCHED_*=value for the fair_sched server")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fair_sched.json"))
    ap.add_argument("--plot", default="", help="default: benchmarks/results/fair_sched_<mix>.png")
    ap.add_argument("--baseline-json", default="", help="reuse the other policies' runs of this mix from an earlier "
                    "results file (same seeds and rates: pass its capacity with --capacity)")
    ap.add_argument("--settle-s", type=float, default=0.0, help="first wait up to this long for the CPU to go idle")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--no-results-md", action="store_true", help="write JSON and plot but no RESULTS.md row")
    args = ap.parse_args()
    # A TERM (e.g. a timeout) must still stop the servers: leave through the ExitStack.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mix = MIXES[args.mix]
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    command = "python " + " ".join(sys.argv)
    runs: list[dict[str, Any]] = []
    requests: dict[str, list[list[Any]]] = {}
    outputs: dict[str, dict[str, list[int]]] = {}
    t_start = time.time()
    if args.settle_s:
        busy = wait_for_quiet(args.settle_s)
        print(f"machine CPU busy {busy:.0%} after {time.time() - t_start:.0f}s of settling", flush=True)
    with ExitStack() as stack:
        servers = start_servers(stack, args.policies, args, model)
        for name, srv in servers.items():
            warm_up(srv.base_url, name)
        cal_srv = servers.get("fcfs") or next(iter(servers.values()))
        cal = measure(cal_srv.base_url, mix, 0 if args.capacity else args.cal_requests)
        if args.capacity:
            cal["capacity_req_s"] = args.capacity
        cal["machine_loadavg_1m"] = os.getloadavg()[0]
        print(f"calibration: {json.dumps(cal)}", flush=True)
        solo = solo_fn(cal)
        for seed in range(args.seeds):
            order = list(args.policies) if seed % 2 == 0 else list(reversed(args.policies))
            for policy in order:
                srv = servers[policy]
                for load in args.loads:
                    rate = load * cal["capacity_req_s"]
                    jobs = make_trace(mix, args.requests, rate, seed)
                    flush_cache(srv)
                    before = counters(srv) if policy == "fair_sched" else {}
                    t0 = time.perf_counter()
                    outs = run_jobs(srv.base_url, jobs)
                    wall = time.perf_counter() - t0
                    key = f"{policy}@{load}/s{seed}"
                    row = {"mix": mix.name, "load": load, "seed": seed, "policy": policy, "rate_req_s": rate,
                           "requests": len(jobs), **summarize(outs, wall, solo), "key": key,
                           "machine_loadavg_1m": os.getloadavg()[0]}
                    if before:
                        after = counters(srv)
                        row["fair_sched_counters"] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
                    runs.append(row)
                    requests[key] = [[o.kind, o.prompt_len, round(o.ttft_s, 4), round(o.tpot_s, 4)] for o in outs]
                    outputs[key] = {o.rid: o.output_ids for o in outs}
                    if not args.no_record:  # keep what was measured if the run is cut short
                        with open(args.out + f".{mix.name}.partial", "w", encoding="utf-8") as fh:
                            json.dump({"command": command, "calibration": cal, "runs": runs, "requests": requests}, fh)
                    print(f"[{time.time() - t_start:5.0f}s] {key} rate={rate:.2f}/s wall={wall:.0f}s "
                          f"ttft mean={row['ttft_s']['mean']:.2f} p90={row['ttft_s']['p90']:.2f} "
                          f"p99={row['ttft_s']['p99']:.2f} short p90={row['ttft_short_s']['p90']:.2f} "
                          f"long mean={row['ttft_long_s']['mean']:.2f} tpot={row['tpot_s']['mean'] * 1000:.0f}ms "
                          f"thr={row['throughput_req_s']:.2f} loadavg={row['machine_loadavg_1m']:.1f} "
                          f"cached={row['cached_prompt_tokens']} "
                          f"{row.get('fair_sched_counters', '')}", flush=True)
    baseline_command = ""
    if args.baseline_json:
        with open(args.baseline_json, encoding="utf-8") as fh:
            old = json.load(fh)
        baseline_command = old["mixes"][mix.name]["command"]
        req_file = os.path.join(os.path.dirname(args.baseline_json), old["mixes"][mix.name]["requests_file"])
        with open(req_file, encoding="utf-8") as fh:
            old_requests = json.load(fh)
        for r in old["runs"]:
            if r.get("mix") == mix.name and r["policy"] not in args.policies and r["load"] in args.loads \
                    and r["seed"] < args.seeds and abs(r["rate_req_s"] - r["load"] * cal["capacity_req_s"]) < 1e-6:
                key = f"{r['policy']}@{r['load']}/s{r['seed']}"
                runs.append(dict(r, key=key, baseline_from=baseline_command))
                requests[key] = old_requests[key]
    for r in runs:
        base = f"fcfs@{r['load']}/s{r['seed']}"
        if base in outputs and r["key"] in outputs and r["policy"] != "fcfs":
            a, b = outputs[r["key"]], outputs[base]
            r["outputs_identical_to_fcfs"] = sum(a[k] == b.get(k) for k in a) / len(a)
    text = table(runs, args.loads)
    ident = ", ".join(f"{r['key']}: {r['outputs_identical_to_fcfs']:.0%}" for r in runs if "outputs_identical_to_fcfs" in r)
    text += f"\nrequests with outputs identical to fcfs: {ident}\ncalibration ({mix.name} mix): " + json.dumps(
        {k: round(v, 4) for k, v in cal.items()})
    print(text, flush=True)
    from kllm_plugins.plugins.fair_sched.config import FairSchedConfig
    from kllm_plugins.plugins.fair_sched.core import max_stretch_bound

    env_cfg = {kv.split("=", 1)[0].removeprefix("KLLM_FAIR_SCHED_").lower(): kv.split("=", 1)[1] for kv in args.fair_env}
    from kllm_plugins.spec import parse_bool

    def typed(k: str, v: str) -> Any:
        default = getattr(FairSchedConfig(), k)
        return parse_bool(v) if isinstance(default, bool) else type(default)(v)

    cfg = FairSchedConfig(**{k: typed(k, v) for k, v in env_cfg.items()})
    k_bound = max_stretch_bound(mix.long_min, mix.long_max, cfg.quota_params(args.chunk))
    stretch = max((r["long_ttft_over_solo"]["max"] for r in runs if r["policy"] == "fair_sched"), default=float("nan"))
    text += f"\nstarvation bound K = {k_bound:.2f} (fair_sched config {env_cfg or 'defaults'}); measured max long TTFT/solo: {stretch:.2f}"
    print(text.splitlines()[-1], flush=True)
    plot_path = args.plot or os.path.join(ROOT, "benchmarks", "results", f"fair_sched_{mix.name}.png")
    if args.no_record:
        return
    meta = {"calibration": cal, "fair_env": env_cfg, "baseline_from": baseline_command, "stretch_bound_k": k_bound, "dtype": args.dtype,
            "requests_file": f"fair_sched_{mix.name}_requests.json"}
    write_json(args.out, mix.name, command, meta, runs)
    with open(os.path.join(os.path.dirname(args.out), meta["requests_file"]), "w", encoding="utf-8") as fh:
        json.dump(requests, fh)
    plot(runs, requests, args.loads, plot_path, mix.name)
    if args.no_results_md:
        return
    append_results_md(ROOT, command, text, f"Mix `{mix.name}`; plot {os.path.relpath(plot_path, ROOT)}; figures in "
                      f"{os.path.relpath(args.out, ROOT)}.")


if __name__ == "__main__":
    main()
