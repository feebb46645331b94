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
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import closed_loop, free_port, merge_results, open_loop, py, quantile, spawn, stop, wait_http  # noqa: E402
from kllm_plugins.testing.sglang_server import flush_cache  # noqa: E402

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


def cpu_user_system(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process and its threads (Linux /proc, 10 ms ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its threads (Linux /proc)."""
    return sum(cpu_user_system(pid))


def cpu_ns(pid: int) -> int:
    """CPU time of all the process's threads in ns, from the scheduler's accounting
    (/proc/PID/task/*/schedstat): exact where `cpu_seconds` counts 10 ms ticks."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                total += int(fh.read().split()[0])
        except OSError:  # a thread that just ended
            pass
    return total


def med(xs: list[float]) -> float:
    """The harness's median (numpy.percentile-compatible), rounded; NaN for no samples."""
    return round(quantile(xs, 0.5), 3) if xs else float("nan")


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
    ap.add_argument("--no-record", action="store_true", help="do not write the results files (smoke runs)")
    ap.add_argument("--bench-serving", metavar="MODEL_PATH",
                    help="instead: sglang.bench_serving against a real server on this model, direct vs kllm-router")
    ap.add_argument("--bs-prompts", type=int, default=40)
    ap.add_argument("--bs-input-len", type=int, default=128)
    ap.add_argument("--bs-output-len", type=int, default=64)
    ap.add_argument("--bs-concurrency", type=int, default=4)
    ap.add_argument("--bs-backend", choices=["fake", "sglang"], default="sglang",
                    help="behind the router: the fake backend (router cost only) or a real SGLang server")
    ap.add_argument("--bs-fake-ttft-s", type=float, default=0.02)
    ap.add_argument("--bs-fake-tpot-s", type=float, default=0.01)
    ap.add_argument("--bs-baseline-tree", help="also run the router code of this checkout, in the same rounds")
    ap.add_argument("--bs-short-output-len", type=int, default=-1,
                    help="router CPU per token is the slope between the rounds' output length and this one (one "
                         "more run per router per round, its CPU only; -1: output length / 8, at least 2; 0: off)")
    ap.add_argument("--bs-idle-s", type=float, default=3.0,
                    help="per round, the routers' CPU over this many seconds with no traffic (0: not measured)")
    ap.add_argument("--bs-max-s", type=float, default=0.0, help="start no round after this many seconds (0: no bound)")
    ap.add_argument("--bs-pin", metavar="SERVER_CPUS:ROUTER_CPUS", default="",
                    help="real backend only: run the server on SERVER_CPUS and the router and the client on "
                         "ROUTER_CPUS (taskset lists, e.g. 1:0; auto: the machine's physical cores in two halves), "
                         "one torch thread in the server, so that the router does not take CPU from the server; "
                         "recorded as backend sglang-pinned (with --bs-gpu: sglang-gpu-pinned)")
    ap.add_argument("--bs-gpu", action="store_true",
                    help="real backend only: the server on the GPU (kllm_cuda platform, Triton attention, CUDA "
                         "graphs); recorded as backend sglang-gpu in gpu_overhead_bench_serving.json")
    ap.add_argument("--bs-out-root", default="",
                    help="record under <this>/benchmarks/results (default: the repository; the device suite "
                         "passes its output folder)")
    ap.add_argument("--bs-from-log", default="", metavar="LOG",
                    help="record the rounds that a run cut by its time limit printed to LOG (with the same "
                         "--bs-* options as that run) instead of measuring")
    args = ap.parse_args()
    if args.bs_gpu and args.bs_backend != "sglang":
        ap.error("--bs-gpu needs --bs-backend sglang")
    if args.bs_pin and (args.bs_backend != "sglang" or not parse_pin(args.bs_pin)):
        ap.error("--bs-pin needs --bs-backend sglang and the form SERVER_CPUS:ROUTER_CPUS, e.g. 1:0")
    pin = parse_pin(args.bs_pin)
    if pin and args.bs_pin == "auto" and args.bs_from_log:  # the split was the measuring machine's, not this one's
        pin = ("auto: half of the physical cores", "auto: the other half")
    if args.bench_serving:
        return bench_serving_overhead(args.bench_serving, args.bs_backend, args.rounds, args.bs_prompts,
                                      args.bs_input_len, args.bs_output_len, args.bs_concurrency,
                                      args.bs_fake_ttft_s, args.bs_fake_tpot_s, not args.no_record,
                                      args.bs_baseline_tree, args.bs_max_s, pin,
                                      args.bs_gpu, args.bs_out_root, args.bs_from_log,
                                      args.bs_short_output_len, args.bs_idle_s)
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
    # the summary line (benchmarks/RESULTS.md is generated from the results files)
    print(f"| bigpd_router | router overhead {datetime.date.today()}, lean data path: 2 fake backends "
          f"answering at once, open loop, {args.rounds} interleaved rounds x {args.duration_s:.0f} s, "
          f"medians; added P50/P99 over direct; load average before/after {load_before[0]:.2f}/{load_after[0]:.2f} | {summary}; max closed-loop req/s: {maxes} | `{command}` |")


def _datasets_for_bench_serving() -> None:
    """`sglang.bench_serving` imports every dataset loader, and the MMMU one imports `datasets` at
    module level; the GPU image lacks that package. Where it is missing, a module whose
    `load_dataset` raises stands in, so the random-ids runs here import (no loader of ours uses it)."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        import types

        def load_dataset(*_a: Any, **_k: Any) -> Any:
            raise ImportError("the `datasets` package is not installed (only random-ids runs work here)")

        sys.modules["datasets"] = types.ModuleType("datasets")
        sys.modules["datasets"].load_dataset = load_dataset  # type: ignore[attr-defined]


def rows_from_log(path: str) -> tuple[list[dict[str, Any]], int, str | None, list[dict[str, Any]]]:
    """The per-round rows a run printed after the last finished run's summary line in the same log,
    the number of rounds complete for every target (a cut round is dropped), the GPU the
    kllm_cuda platform named in the log, if any, and the routers' CPU rows of those rounds."""
    import re

    rows: list[dict[str, Any]] = []
    cpu_rows: list[dict[str, Any]] = []
    device = None
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("sglang.bench_serving via kllm-router"):
                rows, cpu_rows = [], []
            elif line.startswith('{"round"'):
                rows.append(json.loads(line))
            elif line.startswith('{"cpu"'):
                cpu_rows.append(json.loads(line))
            elif m := re.search(r"kllm_cuda platform \(pid \d+\): ([^,]+),", line):
                device = m.group(1)
    targets = {r["target"] for r in rows}
    rounds = 0
    while all(any(r["round"] == rounds and r["target"] == t for r in rows) for t in targets) and targets:
        rounds += 1
    if rounds < 2 or "direct" not in targets:
        raise SystemExit(f"{path}: fewer than two complete rounds after the last summary line")
    return ([r for r in rows if r["round"] < rounds], rounds, device,
            [r for r in cpu_rows if r["round"] < rounds])


def router_cpu_s(cpu_rows: list[dict[str, Any]], router: str, output_len: int) -> float | None:
    """The router's CPU seconds over its full-length runs (None where not measured)."""
    runs = [r["cpu_s"] for r in cpu_rows
            if r["cpu"] == "run" and r["target"] == router and r["output_len"] == output_len]
    return sum(runs) if runs else None


def split_by_core(topology: dict[int, tuple[int, int]]) -> tuple[str, str] | None:
    """CPUs -> (package, core): the first half of the physical cores (every hyperthread of each) for
    the server, the rest for the router and client, so they share no core; None under two cores."""
    cores = sorted(set(topology.values()))
    if len(cores) < 2:
        return None
    mine = set(cores[:len(cores) // 2])
    server = sorted(c for c, k in topology.items() if k in mine)
    router = sorted(c for c, k in topology.items() if k not in mine)
    return ",".join(map(str, server)), ",".join(map(str, router))


def machine_topology() -> dict[int, tuple[int, int]]:
    """This machine's usable CPUs and their (package, core) from sysfs."""
    out = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as pk, open(f"{base}/core_id") as co:
                out[cpu] = (int(pk.read()), int(co.read()))
        except OSError:
            out[cpu] = (0, cpu)  # unknown: every CPU its own core
    return out


def parse_pin(spec: str) -> tuple[str, str] | None:
    """"1:0" -> ("1", "0"): the server's CPU list and the router's (taskset -c syntax); "auto": this
    machine's physical cores split in two halves (`split_by_core`); None if absent or malformed."""
    if spec == "auto":
        return split_by_core(machine_topology())
    server, sep, router = spec.partition(":")
    ok = sep and all(part and all(c.isdigit() or c in ",-" for c in part) for part in (server, router))
    return (server, router) if ok else None


def cpu_list(spec: str) -> set[int]:
    """taskset's list syntax, "0,2-3" -> {0, 2, 3}."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _bench_serving_once(url: str, model_path: str, num_prompts: int, input_len: int, output_len: int,
                        concurrency: int, seed: int, out: str) -> dict[str, Any]:
    """One `sglang.bench_serving` run (its own `cli_main`, called in this process so the module is
    imported once for all rounds); returns its result line."""
    import contextlib
    import io

    from sglang.benchmark import serving

    argv = ["sglang.bench_serving", "--backend", "sglang", "--base-url", url, "--model", model_path,
            "--tokenizer", model_path, "--dataset-name", "random-ids", "--num-prompts", str(num_prompts),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "1.0", "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--disable-tqdm", "--output-file", out]
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            serving.cli_main()
    finally:
        sys.argv = saved
    with open(out, encoding="utf-8") as fh:
        return json.loads(fh.read().strip().splitlines()[-1])


BS_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "median_tpot_ms", "median_e2e_latency_ms")


def bench_serving_overhead(model_path: str, backend: str, rounds: int, num_prompts: int, input_len: int,
                           output_len: int, concurrency: int, ttft_s: float, tpot_s: float, record: bool,
                           baseline_tree: str | None = None, max_s: float = 0.0,
                           pin: tuple[str, str] | None = None, gpu: bool = False, out_root: str = "",
                           from_log: str = "", short_len: int = -1, idle_s: float = 3.0) -> None:
    """`sglang.bench_serving` directly against one backend and through kllm-router to it, interleaved
    (direct, router; then router, direct; ...), the same prompts (seed) for both in a round. The
    backend is the fake one (`fake`: paced tokens, no model, so only the router's cost differs) or a
    real SGLang server on the CPU platform (`sglang`). Added figures per round are router minus
    direct of that round's medians; the cost per output token is the added median TPOT, cross-checked
    against (added E2E - added TTFT) / (output_len - 1). Router CPU per relayed token is the slope of
    the router's CPU per request between the round's output length and `short_len` (each router runs
    the same prompts once more at that length, CPU only): the per-request part and the background
    loops' idle part do not count as tokens. Beside it, per request (the intercept), idle (ms of CPU a
    second over `idle_s` with no traffic, all routers at once, per round), the router's CPU of the
    rounds less its idle rate over their time, per token, and, as reported before, all of its CPU
    during its rounds over the tokens it relayed (which counts per-request and idle CPU as tokens'). `baseline_tree`: the router
    code of another checkout runs as a third target in the same rounds (before/after a change).
    `max_s` > 0: no new round starts after that many seconds (at least two rounds run). `pin`: the
    server's and the router's CPU lists (the client runs on the router's). `gpu`: the server runs on
    the GPU through the kllm_cuda platform, and the summary goes to its own file (the fake backend's
    rows are kept apart too when `out_root` is given: a device run records only what it measured).
    `from_log`: record the rounds a cut run printed to its log instead of measuring (router CPU unknown)."""
    from kllm_plugins.bench.record import machine_description, record as write_record
    from kllm_plugins.bench.stats import ratio_of_medians, spread

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    _datasets_for_bench_serving()
    load_before = os.getloadavg()
    short = short_len if short_len >= 0 else max(2, output_len // 8)
    if short >= output_len:
        short = 0
    if from_log:  # a run the step limit cut after its last round: its rows, as printed
        rows, rounds, log_device, cpu_rows = rows_from_log(from_log)
    else:
        tmp = tempfile.mkdtemp(prefix="kllm-bs-")
        cpu_rows = []
        server = None
        procs = []
        if backend == "fake":
            bport = free_port()
            # it reports the model folder, so the router learns the vocabulary and checks token ids as in production
            procs.append(spawn([py(), "-m", FAKE, "--port", str(bport), "--ttft-s", str(ttft_s), "--tpot-s", str(tpot_s),
                                "--model-info-path", model_path], f"{tmp}/fake.log"))
            base = f"http://127.0.0.1:{bport}"
            wait_http(base + "/health")
            backend_pid = procs[0].pid
        else:
            from kllm_plugins.testing.sglang_server import SGLangServer

            env: dict[str, str] = {}
            if pin:  # the server's processes keep to their cores; torch's threads to one each
                env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            extra: list[str] = []
            if gpu:
                env.update(SGLANG_PLATFORM="kllm_cuda", KLLM_CUDA_GRAPHS="1")
                extra = ["--sampling-backend", "pytorch", "--attention-backend", "triton", "--mem-fraction-static", "0.3"]
            server = SGLangServer(model_path, max_total_tokens=8192, startup_timeout_s=480.0, env=env or None,
                                  extra_args=extra, cpu_platform=not gpu)
            if pin:  # every process and thread of the server inherits the mask
                server.args[:0] = ["taskset", "-c", pin[0]]
                os.sched_setaffinity(0, cpu_list(pin[1]))  # this client, before it starts any thread
            server.start()
            base = server.base_url
            assert server.proc is not None
            backend_pid = server.proc.pid
        targets = [("direct", base, 0)]
        for name, tree in [("kllm", None)] + ([("baseline", baseline_tree)] if baseline_tree else []):
            rport = free_port()
            cmd = router_cmd("kllm", rport, [base])
            assert cmd is not None
            if pin:
                cmd = ["taskset", "-c", pin[1], *cmd]
            if tree:  # the same command line on another checkout's plugins folder
                boot = ("import sys, kllm_plugins.plugins as p; p.__path__[:] = [sys.argv.pop(1) + '/plugins']; "
                        "from kllm_plugins.plugins.bigpd_router.service.cli import main; main()")
                at = cmd.index(py())
                cmd = [*cmd[:at], py(), "-c", boot, tree, *cmd[at + 3:]]
            proc = spawn(cmd, f"{tmp}/router-{name}.log")
            procs.append(proc)
            targets.append((name, f"http://127.0.0.1:{rport}", proc.pid))
        rows: list[dict[str, Any]] = []
        try:
            for _, url, pid in targets[1:]:
                wait_http(url + "/health", 60)
            # warm-up: connections, tokenizer, the server's first batches
            for _, url, _ in targets:
                _bench_serving_once(url, model_path, max(4, concurrency), input_len, output_len, concurrency, 999,
                                    f"{tmp}/warm.jsonl")
            t_start = time.monotonic()
            for rnd in range(rounds):
                if max_s and rnd >= 2 and time.monotonic() - t_start > max_s:
                    print(f"time budget {max_s:.0f} s spent: {rnd} rounds of {rounds}", flush=True)
                    rounds = rnd
                    break
                # the order rotates, so each target takes each position equally often over the rounds;
                # the backend's prefix cache is emptied before each target, or whichever runs second in a
                # round would find the same prompts cached
                if idle_s > 0:  # the routers' background alone: all at once, nothing sent
                    time.sleep(0.5)
                    marks = {name: (cpu_ns(pid), time.monotonic()) for name, _, pid in targets[1:]}
                    time.sleep(idle_s)
                    for name, _, pid in targets[1:]:
                        ns, t0 = marks[name]
                        cpu_rows.append({"cpu": "idle", "round": rnd, "target": name,
                                         "cpu_s": (cpu_ns(pid) - ns) / 1e9, "wall_s": time.monotonic() - t0})
                        print(json.dumps(cpu_rows[-1]), flush=True)
                k = rnd % len(targets)
                for name, url, pid in targets[k:] + targets[:k]:
                    for length in (output_len, short) if pid and short else (output_len,):
                        flush_cache(targets[0][1])
                        c0, t0 = (cpu_ns(pid) if pid else 0), time.monotonic()
                        res = _bench_serving_once(url, model_path, num_prompts, input_len, length, concurrency, rnd,
                                                  f"{tmp}/{name}-{rnd}-{length}.jsonl")
                        if pid:
                            cpu = (cpu_ns(pid) - c0) / 1e9
                            cpu_rows.append({"cpu": "run", "round": rnd, "target": name, "output_len": length,
                                             "completed": res["completed"], "output_tokens": res["total_output_tokens"],
                                             "cpu_s": cpu, "wall_s": time.monotonic() - t0})
                            print(json.dumps(cpu_rows[-1]), flush=True)
                        if length != output_len:
                            continue  # the short run: the router's CPU only
                        row = {"round": rnd, "target": name, "completed": res["completed"],
                               "output_tokens": res["total_output_tokens"]}
                        row.update({k: round(float(res[k]), 3) for k in BS_KEYS})
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for p in procs:
                stop(p)
            if server is not None:
                server.stop()
    by = {(r["round"], r["target"]): r for r in rows}

    def figures(router: str) -> dict[str, Any]:
        pairs = [(by[(k, router)], by[(k, "direct")]) for k in range(rounds)]

        def added(key: str) -> dict[str, Any]:
            return spread([round(r[key] - d[key], 4) for r, d in pairs])

        def ratio(key: str) -> dict[str, Any]:
            return ratio_of_medians([r[key] for r, _ in pairs], [d[key] for _, d in pairs])

        via_e2e = [round(((r["median_e2e_latency_ms"] - d["median_e2e_latency_ms"])
                          - (r["median_ttft_ms"] - d["median_ttft_ms"])) / max(1, output_len - 1), 4)
                   for r, d in pairs]
        relayed = sum(r["output_tokens"] for r, _ in pairs)
        return {
            "added_median_ttft_ms": added("median_ttft_ms"),
            "added_p99_ttft_ms": added("p99_ttft_ms"),
            "added_median_tpot_ms": added("median_tpot_ms"),
            "added_median_itl_ms": added("median_itl_ms"),
            "added_per_token_ms_from_e2e": spread(via_e2e),
            "added_median_e2e_ms": added("median_e2e_latency_ms"),
            "ratio_median_ttft": ratio("median_ttft_ms"),
            "ratio_median_tpot": ratio("median_tpot_ms"),
            "ratio_median_e2e": ratio("median_e2e_latency_ms"),
            "router_cpu_us_per_token": (None if (cpu := router_cpu_s(cpu_rows, router, output_len)) is None
                                        else round(cpu * 1e6 / max(1, relayed), 1)),
            **cpu_figures(router),
            "failed": sum(num_prompts - r["completed"] for r, _ in pairs),
        }

    def cpu_figures(router: str) -> dict[str, Any]:
        """The router's CPU split: per token (slope between the two output lengths), per request
        (intercept), idle; and its CPU of the rounds less idle, per token. None where not measured."""
        idle = {r["round"]: r["cpu_s"] / r["wall_s"] for r in cpu_rows
                if r["cpu"] == "idle" and r["target"] == router and r["round"] < rounds}
        runs = {(r["round"], r["output_len"]): r for r in cpu_rows
                if r["cpu"] == "run" and r["target"] == router and r["round"] < rounds}
        slope, per_request, less_idle = [], [], []
        for k in range(rounds):
            long, sh = runs.get((k, output_len)), runs.get((k, short))
            if long is None:
                continue
            if k in idle:
                less_idle.append(round((long["cpu_s"] - idle[k] * long["wall_s"]) * 1e6
                                       / max(1, long["output_tokens"]), 2))
            if sh is not None and long["completed"] and sh["completed"]:
                tl, ts = long["output_tokens"] / long["completed"], sh["output_tokens"] / sh["completed"]
                if tl > ts:
                    b = (long["cpu_s"] / long["completed"] - sh["cpu_s"] / sh["completed"]) / (tl - ts)
                    slope.append(round(b * 1e6, 2))
                    per_request.append(round((sh["cpu_s"] / sh["completed"] - b * ts) * 1e6, 1))
        return {
            "router_cpu_us_per_token_slope": spread(slope) if slope else None,
            "router_cpu_us_per_request": spread(per_request) if per_request else None,
            "router_idle_cpu_ms_per_s": spread([round(v * 1e3, 3) for v in idle.values()]) if idle else None,
            "router_cpu_us_per_token_less_idle": spread(less_idle) if less_idle else None,
        }

    metrics = figures("kllm")
    direct = [by[(k, "direct")] for k in range(rounds)]
    metrics["direct_median_ttft_ms"] = spread([d["median_ttft_ms"] for d in direct])
    metrics["direct_median_tpot_ms"] = spread([d["median_tpot_ms"] for d in direct])
    metrics["direct_failed"] = sum(num_prompts - d["completed"] for d in direct)
    if baseline_tree:
        metrics["baseline"] = figures("baseline")
        metrics["baseline"]["tree"] = baseline_tree
        if metrics["router_cpu_us_per_token"] is not None and metrics["baseline"]["router_cpu_us_per_token"]:
            metrics["router_cpu_all_per_token_vs_baseline"] = round(
                metrics["router_cpu_us_per_token"] / metrics["baseline"]["router_cpu_us_per_token"], 3)
        ours, theirs = metrics["router_cpu_us_per_token_slope"], metrics["baseline"]["router_cpu_us_per_token_slope"]
        if ours and theirs and theirs["median"] > 0:
            metrics["router_cpu_per_token_vs_baseline"] = round(ours["median"] / theirs["median"], 3)
    targets_met = (metrics["added_median_ttft_ms"]["median"] < 1.0
                   and metrics["added_median_tpot_ms"]["median"] < 0.05)
    setup = {"backend": backend, "rounds": rounds, "num_prompts": num_prompts, "input_len": input_len,
             "output_len": output_len, "max_concurrency": concurrency, "dataset": "random-ids",
             "targets": "added median TTFT < 1 ms, added per output token < 0.05 ms", "targets_met": targets_met}
    if backend == "fake":
        setup.update(fake_ttft_s=ttft_s, fake_tpot_s=tpot_s)
    if short:
        setup.update(router_cpu_short_output_len=short)
    if idle_s > 0:
        setup.update(router_idle_s=idle_s)
    if pin:
        setup.update(server_cpus=pin[0], router_and_client_cpus=pin[1], server_torch_threads=1)
        backend = "sglang-pinned"
    if gpu:
        backend = "sglang-gpu-pinned" if pin else "sglang-gpu"
    load_after = os.getloadavg()

    def cpu_text(m: dict[str, Any]) -> str:
        def med_of(key: str, fmt: str) -> str:
            v = m.get(key)
            return "n/a" if v is None else format(v["median"], fmt)
        return (f"{med_of('router_cpu_us_per_token_slope', '.1f')} us/token (slope {short}->{output_len} tokens), "
                f"{med_of('router_cpu_us_per_request', '.0f')} us/request, idle "
                f"{med_of('router_idle_cpu_ms_per_s', '.2f')} ms/s, all CPU / tokens {m['router_cpu_us_per_token']} "
                f"us/token")

    print(f"sglang.bench_serving via kllm-router vs direct, {backend} backend, {rounds} interleaved rounds: "
          f"added median TTFT {metrics['added_median_ttft_ms']['median']:.3f} ms "
          f"[{metrics['added_median_ttft_ms']['min']:.3f}, {metrics['added_median_ttft_ms']['max']:.3f}], "
          f"added median TPOT {metrics['added_median_tpot_ms']['median']:.4f} ms "
          f"[{metrics['added_median_tpot_ms']['min']:.4f}, {metrics['added_median_tpot_ms']['max']:.4f}], "
          f"per token from E2E {metrics['added_per_token_ms_from_e2e']['median']:.4f} ms, router CPU "
          f"{cpu_text(metrics)}"
          + (f" (baseline: {cpu_text(metrics['baseline'])}, added TTFT "
             f"{metrics['baseline']['added_median_ttft_ms']['median']:.3f} ms, TPOT "
             f"{metrics['baseline']['added_median_tpot_ms']['median']:.4f} ms)" if baseline_tree else "")
          + f"; targets met: {targets_met}; load average "
          f"{load_before[0]:.2f} -> {load_after[0]:.2f}")
    if not record:
        return
    from pathlib import Path

    from kllm_plugins.bench.record import git_commit, load_summary, result_path

    name = "gpu_overhead_bench_serving" if gpu or out_root or from_log else "overhead"  # a log is a device run's
    path = result_path("bigpd_router", name, Path(out_root) if out_root else None)
    old = load_summary(path) if path.exists() else {}
    parts = {k: v for k, v in (old.get("metrics") or {}).items() if k != backend}
    parts[backend] = metrics
    setups = {k: v for k, v in (old.get("setup") or {}).items() if k != backend}
    setups[backend] = dict(setup, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                           load_average_before_after=[round(load_before[0], 2), round(load_after[0], 2)])
    if from_log:  # the rows are the device run's: its commit ($KLLM_COMMIT) and machine, not this checkout's
        setups[backend].update(recorded_from_log=os.path.basename(from_log), load_average_before_after=None,
                               date=old.get("date"))
    commands = {k: v for k, v in (old.get("commands") or {}).items() if k != backend}
    commands[backend] = " ".join(["python", *sys.argv])
    shared = "one job at a time" if out_root else "shared 2-core, several helpers; benchmarks under flock"
    if from_log:
        machine = (old.get("machine") or "the device run's machine") + (f"; {log_device}" if log_device else "")
    elif gpu:
        import torch

        machine = machine_description(f"{shared}; {torch.cuda.get_device_name(0)}")
    else:
        machine = machine_description(shared)
    write_record("bigpd_router", name, " && ".join(commands[k] for k in sorted(commands)), parts,
                 root=Path(out_root) if out_root else None, machine=machine,
                 commit=(os.environ.get("KLLM_COMMIT") if from_log else None) or git_commit(),
                 commands=commands, setup=setups,
                 per_round={**{k: v for k, v in (old.get("per_round") or {}).items() if k != f"{backend}:router_cpu"},
                            backend: rows, **({f"{backend}:router_cpu": cpu_rows} if cpu_rows else {})},
                 notes="added = router minus direct, per round (interleaved, same prompts), median and spread over "
                       "rounds; metrics per backend: fake (paced tokens, isolates the router), sglang (real "
                       "server, tiny model, kllm_cpu platform), sglang-pinned (server and router on separate "
                       "cores), sglang-gpu (tiny model served on the GPU, kllm_cuda, CUDA graphs; -pinned: server and router "
                       "on separate physical cores). Router CPU: "
                       "router_cpu_us_per_token_slope is the cost per relayed token (slope of CPU per request "
                       "between the short and the full output length, per round), router_cpu_us_per_request the "
                       "intercept, router_idle_cpu_ms_per_s the background with no traffic; router_cpu_us_per_token "
                       "is all of the router's CPU during its rounds over the tokens relayed (it counts the "
                       "per-request and background CPU as tokens'; the figure reported before the slope)")


if __name__ == "__main__":
    main()
