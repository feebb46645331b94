"""Router overhead: latency the router adds over talking to a backend directly, CPU per request, max rate.

Two fake SGLang backends that answer at once (kllm_plugins...service.fake_backend, no model
path reported) and every router (kllm-router, smg, sglang-router where installed) run side by
side for the whole benchmark. Each round measures, at each rate and for plain and streaming
requests, the backend directly and then each router, in an order that rotates per round; the
added latency of a router in a round is its quantile minus the direct quantile of that round,
and the figures reported are medians over rounds. Router CPU per request comes from the
router process's own CPU time during the open-loop run. The maximum rate is a closed loop
(32 clients) per router per round. Client, routers and backends share this machine's cores.

    python benchmarks/bigpd_router/bench_overhead.py --rates 200 500 1000 --duration-s 3 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import closed_loop, free_port, merge_results, open_loop, py, spawn, stop, wait_http  # noqa: E402

FAKE = "kllm_plugins.plugins.bigpd_router.service.fake_backend"


def router_cmd(name: str, port: int, workers: list[str]) -> list[str] | None:
    if name == "kllm":
        cmd = [py(), "-m", "kllm_plugins.plugins.bigpd_router.service.cli", "--port", str(port),
               "--policy", "round_robin", "--log-level", "WARNING", "--loads-interval-s", "0"]
        for w in workers:
            cmd += ["--worker", w]
        return cmd
    if name == "smg":
        exe = shutil.which("smg") or os.path.join(os.path.dirname(py()), "smg")
        if not os.path.exists(exe):
            return None
        return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--prometheus-port", str(free_port()), "--worker-urls", *workers]
    if name == "sglang-router":
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            return None
        return [py(), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--prometheus-port", str(free_port()), "--worker-urls", *workers]
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", type=float, nargs="+", default=[200.0, 500.0, 1000.0])
    ap.add_argument("--duration-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routers", nargs="+", default=["kllm", "smg", "sglang-router"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--streams", choices=["both", "plain", "stream"], default="both",
                    help="which request kinds to measure (a rerun of some rows keeps the others in the results file)")
    ap.add_argument("--no-max-rate", action="store_true", help="skip the closed-loop maximum-rate runs")
    ap.add_argument("--no-record", action="store_true", help="do not write results or RESULTS.md (smoke runs)")
    ap.add_argument("--bench-serving", metavar="MODEL_PATH",
                    help="instead: sglang.bench_serving against a real server on this model, direct vs kllm-router")
    ap.add_argument("--bs-prompts", type=int, default=40)
    ap.add_argument("--bs-input-len", type=int, default=128)
    ap.add_argument("--bs-output-len", type=int, default=64)
    args = ap.parse_args()
    if args.bench_serving:
        return bench_serving_overhead(args.bench_serving, args.rounds, args.bs_prompts, args.bs_input_len,
                                      args.bs_output_len, not args.no_record)
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="kllm-bench-")
    procs = []
    urls = []
    for i in range(2):
        port = free_port()
        procs.append(spawn([py(), "-m", FAKE, "--port", str(port)], f"{tmp}/fake{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    routers: dict[str, tuple[str, int]] = {}
    try:
        for u in urls:
            wait_http(u + "/health")
        for name in args.routers:
            port = free_port()
            cmd = router_cmd(name, port, urls)
            if cmd is None:
                print(f"{name}: not installed, skipped")
                continue
            proc = spawn(cmd, f"{tmp}/{name}.log")
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}/health", 60)
            routers[name] = (f"http://127.0.0.1:{port}/generate", proc.pid)
        body_plain = {"text": "hello " * 20, "sampling_params": {"max_new_tokens": 4}}
        body_stream = dict(body_plain, stream=True)
        for url, _ in routers.values():
            asyncio.run(open_loop(url, body_plain, 100, 1.0))  # warm-up (connections, caches)
        targets = [("direct", urls[0] + "/generate", None)] + [(n, u, pid) for n, (u, pid) in routers.items()]
        samples: dict[tuple[str, float, bool], list[dict[str, float]]] = {}
        max_rps: dict[str, list[float]] = {n: [] for n in routers}
        kinds = {"both": (False, True), "plain": (False,), "stream": (True,)}[args.streams]
        cases = [(rate, stream) for rate in args.rates for stream in kinds]
        total = args.rounds * (len(cases) * len(targets) + (0 if args.no_max_rate else len(routers)))
        done = 0
        for rnd in range(args.rounds):
            for rate, stream in cases:
                order = targets[:1] + targets[1:][rnd % max(1, len(targets) - 1):] + \
                    targets[1:][:rnd % max(1, len(targets) - 1)]
                for name, url, pid in order:
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    res = asyncio.run(open_loop(url, body_stream if stream else body_plain, rate, args.duration_s,
                                                stream))
                    res["cpu_ms_per_req"] = ((cpu_seconds(pid) - cpu0) * 1000 / max(1, res["ok"])) if pid else 0.0
                    samples.setdefault((name, rate, stream), []).append(res)
                    done += 1
                    print(f"\r[{done}/{total}] round {rnd + 1} {name} rate {rate:.0f} stream={stream}   ",
                          end="", file=sys.stderr, flush=True)
            for name, (url, _) in routers.items():
                if args.no_max_rate:
                    break
                max_rps[name].append(asyncio.run(closed_loop(url, body_plain, args.concurrency, args.duration_s)))
                done += 1
        print(file=sys.stderr)
    finally:
        for p in procs:
            stop(p)
    rows: list[dict[str, Any]] = []
    for name in routers:
        for rate, stream in cases:
            rs, ds = samples[(name, rate, stream)], samples[("direct", rate, stream)]
            rows.append({
                "router": name, "rate_rps": rate, "stream": stream,
                "added_ms": {"p50": med([(r["p50"] - d["p50"]) * 1000 for r, d in zip(rs, ds)]),
                             "p99": med([(r["p99"] - d["p99"]) * 1000 for r, d in zip(rs, ds)])},
                "added_ms_rounds": {"p50": [round((r["p50"] - d["p50"]) * 1000, 3) for r, d in zip(rs, ds)],
                                    "p99": [round((r["p99"] - d["p99"]) * 1000, 3) for r, d in zip(rs, ds)]},
                "router_ms": {"p50": med([r["p50"] * 1000 for r in rs]), "p99": med([r["p99"] * 1000 for r in rs])},
                "direct_ms": {"p50": med([d["p50"] * 1000 for d in ds]), "p99": med([d["p99"] * 1000 for d in ds])},
                "achieved_rps": med([r["achieved_rps"] for r in rs]),
                "failed": sum(r["n"] - r["ok"] for r in rs),
                "cpu_ms_per_req": med([r["cpu_ms_per_req"] for r in rs]),
                "max_rps": med(max_rps[name]) if max_rps[name] else None,
                "max_rps_rounds": [round(x, 1) for x in max_rps[name]],
                "rounds": args.rounds, "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="minutes")})
    print("\nmedians over rounds; added = router - direct in the same round")
    print("router         rate  stream  added p50 ms  added p99 ms  cpu ms/req  failed  max rps")
    for r in rows:
        print(f"{r['router']:<14}{r['rate_rps']:>5.0f}  {str(r['stream']):<6}  {r['added_ms']['p50']:>12.3f}  "
              f"{r['added_ms']['p99']:>12.3f}  {r['cpu_ms_per_req']:>10.3f}  {r['failed']:>6}  "
              f"{r['max_rps'] if r['max_rps'] is not None else float('nan'):>7.0f}")
    by = {(r["router"], r["rate_rps"], r["stream"]): r for r in rows}
    ratios = []
    for rate, stream in cases:
        k, s = by.get(("kllm", rate, stream)), by.get(("smg", rate, stream))
        if k and s:
            ratio = k["added_ms"]["p99"] / s["added_ms"]["p99"] if s["added_ms"]["p99"] > 0 else float("nan")
            ratios.append(f"rate {rate:.0f} stream={stream}: added P99 kllm {k['added_ms']['p99']:.3f} ms vs smg "
                          f"{s['added_ms']['p99']:.3f} ms (ratio {ratio:.2f}); P50 {k['added_ms']['p50']:.3f} vs "
                          f"{s['added_ms']['p50']:.3f} ms; router P99 {k['router_ms']['p99']:.1f} vs "
                          f"{s['router_ms']['p99']:.1f} ms, direct P99 {k['direct_ms']['p99']:.1f} ms")
            print(ratios[-1])
    if "kllm" in routers and "smg" in routers and not args.no_max_rate:
        print(f"max rate (closed loop, {args.concurrency} clients): kllm {med(max_rps['kllm']):.0f} req/s vs smg "
              f"{med(max_rps['smg']):.0f} req/s (ratio {med(max_rps['kllm']) / med(max_rps['smg']):.2f})")
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    if args.no_record:
        return
    command = " ".join(["python", *sys.argv])
    new = {(r["router"], r["rate_rps"], r["stream"]) for r in rows}
    # a partial rerun (some rates or kinds) replaces only its own rows
    merge_results("overhead", rows, command, keep=lambda r: (r["router"], r["rate_rps"], r["stream"]) not in new,
                  command_key="overhead" if args.streams == "both" else f"overhead:{args.streams}")
    summary = "; ".join(
        f"{r['router']} {r['rate_rps']:.0f}/s{' stream' if r['stream'] else ''}: +{r['added_ms']['p50']:.2f}/"
        f"+{r['added_ms']['p99']:.2f} ms (router P99 {r['router_ms']['p99']:.1f}, direct P99 "
        f"{r['direct_ms']['p99']:.1f})" for r in rows)
    maxes = ", ".join(f"{n} {med(v):.0f}" for n, v in max_rps.items() if v) or "not measured"
    with open("benchmarks/RESULTS.md", "a", encoding="utf-8") as fh:
        fh.write(f"| bigpd_router | router overhead {datetime.date.today()}, lean data path: 2 fake backends "
                 f"answering at once, open loop, {args.rounds} interleaved rounds x {args.duration_s:.0f} s, "
                 f"medians; added P50/P99 over direct; load average before/after {load_before[0]:.2f}/{load_after[0]:.2f} | {summary}; max closed-loop req/s: {maxes} | `{command}` |\n")


def bench_serving_overhead(model_path: str, rounds: int, num_prompts: int, input_len: int, output_len: int,
                           record: bool) -> None:
    """`sglang.bench_serving` against one real SGLang server, directly and through kllm-router,
    interleaved (direct, router; then router, direct; ...). Added median TTFT, and added cost per
    output token from the median E2E: (E2E_router - E2E_direct - (TTFT_router - TTFT_direct)) / (out - 1)."""
    from kllm_plugins.testing.sglang_server import SGLangServer

    tmp = tempfile.mkdtemp(prefix="kllm-bs-")
    server = SGLangServer(model_path, max_total_tokens=8192, startup_timeout_s=480.0)
    server.start()
    rport = free_port()
    router = spawn([*router_cmd("kllm", rport, [server.base_url])], f"{tmp}/router.log")
    rows: list[dict[str, Any]] = []
    try:
        wait_http(f"http://127.0.0.1:{rport}/health", 60)
        targets = [("direct", server.base_url), ("kllm", f"http://127.0.0.1:{rport}")]
        cpu0 = cpu_seconds(router.pid)
        for rnd in range(rounds):
            for name, url in (targets if rnd % 2 == 0 else targets[::-1]):
                out = f"{tmp}/{name}-{rnd}.jsonl"
                cmd = [py(), "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
                       "--dataset-name", "random-ids", "--num-prompts", str(num_prompts),
                       "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                       "--random-range-ratio", "1.0", "--tokenizer", model_path, "--max-concurrency", "4",
                       "--seed", str(rnd), "--disable-tqdm", "--output-file", out]
                import subprocess

                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=600)
                with open(out, encoding="utf-8") as fh:
                    res = json.loads(fh.read().strip().splitlines()[-1])
                rows.append({"round": rnd, "target": name, "median_ttft_ms": res["median_ttft_ms"],
                             "median_e2e_ms": res["median_e2e_latency_ms"], "median_itl_ms": res["median_itl_ms"],
                             "completed": res["completed"]})
                print(json.dumps(rows[-1]), flush=True)
        router_cpu_s = cpu_seconds(router.pid) - cpu0
    finally:
        stop(router)
        server.stop()
    by = {(r["round"], r["target"]): r for r in rows}
    ttft = [by[(k, "kllm")]["median_ttft_ms"] - by[(k, "direct")]["median_ttft_ms"] for k in range(rounds)]
    e2e = [by[(k, "kllm")]["median_e2e_ms"] - by[(k, "direct")]["median_e2e_ms"] for k in range(rounds)]
    per_tok = [(e - t) / max(1, output_len - 1) for e, t in zip(e2e, ttft)]
    tokens = rounds * num_prompts * output_len
    summary = {"added_ttft_ms": {"median": med(ttft), "rounds": [round(x, 3) for x in ttft]},
               "added_per_token_ms": {"median": med(per_tok), "rounds": [round(x, 4) for x in per_tok]},
               "router_cpu_ms_per_token": round(router_cpu_s * 1000 / tokens, 4),
               "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "rounds": rounds,
               "machine": f"{os.cpu_count()} cores shared with other work (load average {os.getloadavg()[0]:.1f})",
               "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "per_round": rows}
    print(f"bench_serving through kllm-router vs direct ({rounds} interleaved rounds): added median TTFT "
          f"{summary['added_ttft_ms']['median']} ms {summary['added_ttft_ms']['rounds']}, added per output token "
          f"{summary['added_per_token_ms']['median']} ms {summary['added_per_token_ms']['rounds']}, router CPU "
          f"{summary['router_cpu_ms_per_token']} ms per token")
    if record:
        merge_results("bench_serving_overhead", [summary], " ".join(["python", *sys.argv]))


if __name__ == "__main__":
    main()
