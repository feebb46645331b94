"""Per-request profile of a serial cell (diagnosis, not a recorded benchmark): the long-context trace
or, with `--trace short`, bench_tiers' default synthetic shape.

For each setup (`bench_tiers.setup_servers`: l1_only, hicache = stock, kv_tiers, kv_tiers_fixed) two
servers are started as in bench_tiers.py, warmed up, and the synthetic long-context trace is replayed
with one request in flight per server. Per request: TTFT, cached tokens per tier (SGLang's
`cached_tokens_details`), and the CPU seconds the server's scheduler process spent over the
request's window, split into its main thread (scheduling, prefill) and its other threads (HiCache's
storage threads: L3 writes and prefetches; the plugin's stats thread). At the end the plugin's
counters (decisions, pages written, L3 path time, learned thresholds) per server. Writes a json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import SPACE, setup_servers  # noqa: E402
from replay import _one, assign  # noqa: E402
from trace_gen import generate  # noqa: E402


def scheduler_pid(server: SGLangServer) -> int:
    assert server.proc is not None
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError("no scheduler process found")


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return out


def cpu_split(pid: int, before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    main = after.get(pid, 0.0) - before.get(pid, 0.0)
    other = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    return main, other


def profile(setup: str, trace: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"kvt-prof-{setup}-")
    # "hicache+prefix_keys": stock with HiCache passing prefix keys to the backend, as kv_tiers' setup does;
    # "kv_tiers+staged": the plugin on HiCache's generic page path (a staging copy per page, as stock's)
    name, _, extra = setup.partition("+")
    l3_extra = {"prefix_keys": {"hicache_storage_pass_prefix_keys": True},
                "staged": {"interface_v1": 0}}.get(extra, {})
    servers, plugins = setup_servers(name, store, None, "", args.l1_tokens, args.server_threads, **l3_extra)
    if not args.sleep_on_idle:
        for s in servers:
            s.args.remove("--sleep-on-idle")
    if args.enable_metrics:  # SGLang then reports each request's L3 prefetch wait (storage_prefetch_wait)
        for s in servers:
            s.args.append("--enable-metrics")
    urls = [s.base_url for s in servers]
    try:
        start_all(servers)
        pids = [scheduler_pid(s) for s in servers]
        picks = assign(len(trace), 2, args.seed)
        warm = trace[: args.warmup]
        for i, r in enumerate(warm):
            _one(urls[picks[i]], r, 0, picks[i])
        for s in servers:
            flush(s.base_url)
        time.sleep(0.5)
        results: list[dict[str, Any] | None] = [None] * len(trace)
        spies = []
        if args.py_spy:
            import subprocess

            for k, pid in enumerate(pids):
                spies.append(subprocess.Popen(
                    ["py-spy", "record", "-p", str(pid), "-r", "100", "--threads", "--nonblocking",
                     *(["--gil"] if args.py_spy_gil else ["--idle"]),
                     "--format", "raw", "-o", f"{args.py_spy}-{setup}-{k}.txt", "-d", "600"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        t_start = time.perf_counter()
        whole_before = [thread_cpu(p) for p in pids]

        def worker(k: int) -> None:
            for i in [i for i, s in enumerate(picks) if s == k]:
                before = thread_cpu(pids[k])
                t0 = time.perf_counter() - t_start
                res = _one(urls[k], trace[i], SPACE, k)
                main, other = cpu_split(pids[k], before, thread_cpu(pids[k]))
                results[i] = {**res, "i": i, "t0": t0, "sched_main_cpu_s": main, "sched_other_cpu_s": other}

        ths = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        wall = time.perf_counter() - t_start
        for sp in spies:
            sp.send_signal(2)  # SIGINT: py-spy writes what it has
        for sp in spies:
            sp.wait(timeout=30)
        whole = [cpu_split(p, b, thread_cpu(p)) for p, b in zip(pids, whole_before)]
        time.sleep(1.0)
        stats = [kv_tiers_stats(s) for s in servers] if plugins else []
        rows = [r for r in results if r is not None]
        return {"setup": setup, "wall_s": wall, "requests": rows,
                "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
                "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
                "sched_cpu_s": [{"main": m, "other": o} for m, o in whole], "kv_tiers_stats": stats}
    finally:
        for s in servers:
            s.stop()
        pages = 0
        for _, dirs, files in os.walk(store):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # not the offer markers under .seen/
            pages += sum(1 for f in files if not f.startswith("."))
        print(f"{setup}: {pages} pages in the L3 folder", flush=True)
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="hicache,kv_tiers,kv_tiers_fixed")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--l1-tokens", type=int, default=3072)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep-on-idle", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--py-spy", default="", help="sample the schedulers with py-spy into <prefix>-<setup>-<k>.txt")
    ap.add_argument("--py-spy-gil", action="store_true", help="py-spy samples only the thread holding the GIL")
    ap.add_argument("--enable-metrics", action="store_true",
                    help="servers with --enable-metrics: per request, SGLang's own L3 prefetch wait")
    ap.add_argument("--out", default="/tmp/kvt3/profile.json")
    ap.add_argument("--trace", choices=("long", "short"), default="long",
                    help="long: the long-context synthetic trace; short: bench_tiers' default synthetic shape")
    ap.add_argument("--server-threads", type=int, default=0,
                    help="OpenMP threads per server (0: torch's default, as the 16:22 profile ran)")
    args = ap.parse_args()
    if args.trace == "long":
        trace = list(generate(args.sessions, 3, groups=args.sessions, system_blocks=64, user_blocks=12,
                              answer_blocks=4))
    else:
        trace = list(generate(args.sessions, 3))
    out = []
    for setup in args.setups.split(","):
        p = profile(setup, trace, args)
        out.append(p)
        print(f"{setup}: TTFT mean {p['ttft_mean_s']:.3f} p50 {p['ttft_p50_s']:.3f}, wall {p['wall_s']:.1f} s, "
              f"scheduler cpu {p['sched_cpu_s']}", flush=True)
        for r in sorted(p["requests"], key=lambda r: r["i"]):
            print(f"  #{r['i']:2d} srv{r['server']} in {r['input']:5d} l1 {r['l1']:5d} l2 {r['l2']:5d} l3 {r['l3']:5d} "
                  f"ttft {r['ttft_s']:.3f} e2e {r['e2e_s']:.3f} cpu main {r['sched_main_cpu_s']:.2f} "
                  f"other {r['sched_other_cpu_s']:.2f}", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
