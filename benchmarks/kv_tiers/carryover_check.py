"""Does a bench_tiers.py cell carry work over to the next one? (not collected by pytest; not recorded)

One server lifetime of one setup (two servers, the flags and sizes of the slow-L3 run), then a
sequence of cells in the order given, e.g. the ShareGPT serial cell first, after the 2.5 req/s
open-loop cell and again after itself. For each cell: TTFT, hit rates, makespan, the CPU seconds the
two servers' process trees burnt during the cell, and for a few seconds after it the cores they
still use (a server still busy with queued requests, L3 writes or prefetches shows here), plus
kv_tiers' learned costs. Used to diagnose the slow-L3 ShareGPT serial cell (docs/kv_tiers.md,
"Slow L3 medium, run 2").

    python benchmarks/kv_tiers/carryover_check.py --setup kv_tiers \\
        --cells sharegpt:serial,synthetic:2.5,sharegpt:serial,sharegpt:serial --server-threads 1
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import SPACE, build_traces, setup_servers  # noqa: E402
from replay import arrivals, assign, measure, replay_open, replay_serial  # noqa: E402


def cpu_seconds(servers: list[SGLangServer]) -> float:
    """User + system CPU seconds of the servers' process trees so far."""
    total = 0.0
    for s in servers:
        if s.proc is None:
            continue
        try:
            root = psutil.Process(s.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def cores_after(servers: list[SGLangServer], seconds: float, step_s: float = 0.5) -> list[float]:
    """Cores the servers use, per `step_s`, for `seconds`."""
    out, prev, t0 = [], cpu_seconds(servers), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        time.sleep(step_s)
        cur = cpu_seconds(servers)
        out.append(round((cur - prev) / step_s, 2))
        prev = cur
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", required=True, choices=("l1_only", "hicache", "kv_tiers"))
    ap.add_argument("--cells", required=True, help="trace:step,... (trace synthetic|sharegpt, step serial|rate)")
    ap.add_argument("--server-threads", type=int, default=1, help="as bench_tiers.py (0: torch's default)")
    ap.add_argument("--after-s", type=float, default=6.0, help="seconds of core use sampled after each cell")
    ap.add_argument("--l3-latency-ms", type=float, default=2.0)
    ap.add_argument("--l3-mb-s", type=float, default=1.5)
    ap.add_argument("--out", default="", help="write the cells as json here")
    a = ap.parse_args()
    ns = argparse.Namespace(traces="synthetic,sharegpt", sessions=8, turns=3, conversations=8, groups=0,
                            system_blocks=64, user_blocks=12, answer_blocks=4, sg_min_tokens=1280, sg_max_tokens=2560,
                            medium={"latency_ms": a.l3_latency_ms, "mb_s": a.l3_mb_s})
    traces = build_traces(ns)
    by_kind = {name.split()[0]: name for name in traces}
    store = tempfile.mkdtemp(prefix="kvt-carry-store-")
    mdir = tempfile.mkdtemp(prefix="kvt-carry-medium-")
    servers, plugins = setup_servers(a.setup, store, ns, mdir, 3072, a.server_threads)
    urls = [s.base_url for s in servers]
    log: list[dict[str, Any]] = []
    try:
        start_all(servers)
        warm = traces[by_kind["synthetic"]][:4]
        replay_serial(urls, warm, assign(len(warm), 2, 0), 0)
        print(f"cores after warm-up {cores_after(servers, 3.0)}", file=sys.stderr, flush=True)
        for j, cell in enumerate(a.cells.split(",")):
            kind, step = cell.split(":")
            trace = traces[by_kind[kind]]
            picks = assign(len(trace), 2, 0)
            for s in servers:
                flush(s.base_url)
            time.sleep(0.5)
            c0 = cpu_seconds(servers)
            offset = (100 + j) * SPACE  # a fresh token space per cell, as bench_tiers.py
            if step == "serial":
                res, makespan = replay_serial(urls, trace, picks, offset)
            else:
                res, makespan = replay_open(urls, trace, picks, arrivals(len(trace), float(step), 0), offset)
            cpu = cpu_seconds(servers) - c0
            m = measure(res, makespan, 0.9)
            after = cores_after(servers, a.after_s)
            snaps = [kv_tiers_stats(s) for s in servers] if plugins else []
            log.append({"cell": cell, "ttft_s": m["ttft_s"], "hit_rate": m["hit_rate"], "makespan_s": makespan,
                        "cpu_s_in_cell": cpu, "cores_after": after, "ttfts": [r["ttft_s"] for r in res],
                        "kv_tiers": snaps})
            print(f"{a.setup} {cell}: TTFT mean {m['ttft_s']['mean']:.3f} p50 {m['ttft_s']['p50']:.3f}, hit "
                  f"{m['hit_rate']['total']:.3f} (l2 {m['hit_rate']['l2']:.3f} l3 {m['hit_rate']['l3']:.3f}), "
                  f"{makespan:.1f} s, {cpu:.1f} CPU s, cores after {after}", file=sys.stderr, flush=True)
            for i, snap in enumerate(snaps):
                fp = snap.get("fetch_policy", {})
                print(f"    server {i}: prefill {fp.get('prefill_tokens_per_s', 0):.0f} tok/s, L3 break-even "
                      f"{fp.get('l3_min_fetch_tokens')}, L2 break-even {fp.get('l2_min_fetch_tokens')}, prefetch "
                      f"refused {snap.get('prefetch_refused')} explored {snap.get('prefetch_explored', 0)}, waits "
                      f"{snap.get('prefetch_wait')}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(mdir, ignore_errors=True)
        if a.out:
            Path(a.out).write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    main()
