"""Where a setup's serial cell spends its CPU: bench_tiers' serial cell (one request in flight per
server), per setup, with the CPU seconds of every thread of the servers' scheduler processes.

The serial TTFT of kv_tiers against stock HiCache moved between 0.85x and 1.20x from one server
lifetime to the next on this shared 2-core machine. This replays the cell of the long synthetic grid
(`bench_tiers.py --dtype float32 --sessions 24 --system-blocks 64 --user-blocks 12 --answer-blocks 4
--l1-tokens 3072`, the same trace, servers and warm-up) and reads, around it:

- TTFT per request by where its prefix came from (miss, L1, L2, L3), so a difference shows in the
  requests that cause it (the first turns are the misses, both servers computing them at once);
- CPU seconds of each thread of both scheduler processes (/proc), named by `py-spy dump` where
  py-spy is installed: the scheduler's own thread, HiCache's backup thread (L3 writes), its
  prefetch threads (L3 lookups and reads);
- for kv_tiers, the L3 write path's seconds and pages in the cell (its `/kllm/stats` counters);
- before each lifetime, what creating a page file costs in its L3 folder (bench_tiers' probe): the
  disk stays slow to create files for minutes after a large deletion (a bench run deletes its L3
  folders when it ends), and a lifetime started then spends several times the backup thread's CPU
  on the same writes. The first setup after a run's start meets that state most often.

Setups alternate A B, B A, ... and every repeat starts fresh servers, as bench_tiers'
`--restart-each-repeat`. Prints per repeat and records benchmarks/results/kv_tiers/<--results-name>.json.

    python benchmarks/kv_tiers/serial_threads.py [--setups kv_tiers,hicache] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kllm_plugins.bench import stats
from kllm_plugins.bench.record import record
from kllm_plugins.plugins.kv_tiers.testing import flush
from kllm_plugins.testing.sglang_server import start_all

sys.path.insert(0, str(Path(__file__).parent))
import bench_tiers  # noqa: E402
from bench_report import SHARED  # noqa: E402
from profile_long import scheduler_pid, thread_cpu  # noqa: E402
from replay import assign, measure, replay_serial  # noqa: E402

THREADS = {"MainThread": "scheduler", "backup_thread_func": "l3_backup", "prefetch_io_aux_func": "l3_read",
           "prefetch_thread_func": "l3_lookup"}


def thread_names(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name, from `py-spy dump` ({} without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        return {}
    out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                         timeout=60).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]+)"', out)}


def label(name: str) -> str:
    for key, short in THREADS.items():
        if key in name:
            return short
    return name


def tier_of(r: dict[str, Any]) -> str:
    return "miss" if r["cached"] == 0 else "l3" if r["l3"] else "l2" if r["l2"] else "l1"


def one_cell(name: str, rep: int, trace: list[dict[str, Any]], args: argparse.Namespace, root: str) -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix=f"{name.split('[')[0]}-", dir=root)
    create_ms = bench_tiers.create_cost_ms(store)  # the disk's state: creating a page file, as bench_tiers reports it
    servers, plugins = bench_tiers.setup_servers(name, store, args, "", args.l1_tokens, 1, 2)
    urls = [s.base_url for s in servers]
    try:
        start_all(servers)
        warm = trace[: args.warmup]
        replay_serial(urls, warm, assign(len(warm), 2, args.seed), 0)
        pids = [scheduler_pid(s) for s in servers]
        for s in servers:
            flush(s.base_url)
        time.sleep(0.5)
        before = [thread_cpu(p) for p in pids]
        kv0 = bench_tiers.kept_stats(servers) if plugins else None
        res, makespan = replay_serial(urls, trace, assign(len(trace), 2, args.seed), (1 + rep) * bench_tiers.SPACE)
        time.sleep(0.6)  # stats snapshots are written every 0.5 s
        after = [thread_cpu(p) for p in pids]
        kv1 = bench_tiers.kept_stats(servers) if plugins else None
        names = {tid: label(n) for p in pids for tid, n in thread_names(p).items()}
    finally:
        for s in servers:
            s.stop()
        os.sync()
    cpu: dict[str, list[float]] = {}
    for b, a in zip(before, after):
        per: dict[str, float] = {}
        for tid, c in a.items():
            per[names.get(tid, "other")] = per.get(names.get(tid, "other"), 0.0) + c - b.get(tid, 0.0)
        for k, v in per.items():
            cpu.setdefault(k, []).append(round(v, 3))
    m = measure(res, makespan, 0.9)
    by_tier: dict[str, list[float]] = {}
    for r in res:
        by_tier.setdefault(tier_of(r), []).append(r["ttft_s"])
    out = {"setup": name, "repeat": rep, "create_ms": create_ms, "ttft_mean_s": m["ttft_s"]["mean"],
           "hit": m["hit_rate"]["total"],
           "ttft_by_tier_s": {k: {"n": len(v), "mean": statistics.fmean(v)} for k, v in sorted(by_tier.items())},
           "cpu_s_per_server": cpu}
    if kv0 and kv1:
        out["l3_write_per_server"] = [{"pages": a["pages_admitted"] - b["pages_admitted"],
                                       "seconds": a["path_s"]["write"] - b["path_s"]["write"]} for b, a in zip(kv0, kv1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="kv_tiers,hicache")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("", "float32", "bfloat16"))
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--system-blocks", type=int, default=64)
    ap.add_argument("--user-blocks", type=int, default=12)
    ap.add_argument("--answer-blocks", type=int, default=4)
    ap.add_argument("--l1-tokens", type=int, default=3072)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-name", default="serial_threads")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    shape = argparse.Namespace(groups=0, sessions=args.sessions, turns=3, system_blocks=args.system_blocks,
                               user_blocks=args.user_blocks, answer_blocks=args.answer_blocks, traces="synthetic",
                               conversations=0, sg_max_tokens=768, sg_min_tokens=0)
    trace = next(iter(bench_tiers.build_traces(shape).values()))
    args.medium = None
    setups = bench_tiers.split_setups(args.setups)
    cells = []
    with bench_tiers.run_folder("kvt-serial-threads-") as root:
        for rep in range(args.repeats):
            for name in setups if rep % 2 == 0 else setups[::-1]:
                c = one_cell(name, rep, trace, args, root)
                cells.append(c)
                print(f"{name} rep {rep}: page file create {c['create_ms']:.3f} ms; TTFT mean {c['ttft_mean_s']:.3f} s, hit {c['hit']:.3f}; by tier "
                      + ", ".join(f"{k} {v['mean']:.3f} (n={v['n']})" for k, v in c["ttft_by_tier_s"].items())
                      + "; CPU s per server " + ", ".join(f"{k} {v}" for k, v in sorted(c["cpu_s_per_server"].items())
                                                          if max(v) >= 0.05)
                      + (f"; L3 writes {c['l3_write_per_server']}" if "l3_write_per_server" in c else ""), flush=True)
    metrics: dict[str, Any] = {}
    for name in setups:
        mine = [c for c in cells if c["setup"] == name]
        metrics[name] = {"ttft_mean_s": stats.spread([c["ttft_mean_s"] for c in mine]),
                         "ttft_miss_s": stats.spread([c["ttft_by_tier_s"]["miss"]["mean"] for c in mine
                                                      if "miss" in c["ttft_by_tier_s"]]),
                         **{f"cpu_{k}_s": stats.spread(v) for k in ("scheduler", "l3_backup", "l3_read")
                            if (v := [x for c in mine for x in c["cpu_s_per_server"].get(k, [])])}}
    if len(setups) == 2:
        a, b = setups
        per = [c["ttft_mean_s"] for c in cells if c["setup"] == a], [c["ttft_mean_s"] for c in cells if c["setup"] == b]
        metrics[f"{a}_vs_{b}_ttft"] = stats.ratio_of_medians(per[0], per[1], paired=True)
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    print(metrics)
    if not args.no_record:
        print("recorded", record("kv_tiers", args.results_name, command, metrics, shared=SHARED, cells=cells))


if __name__ == "__main__":
    main()
