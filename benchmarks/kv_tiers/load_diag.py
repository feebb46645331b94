"""Where L3 hits go under open load (diagnosis, not a recorded benchmark).

For each setup (`bench_tiers.setup_servers`) two servers are started with `--enable-metrics`, as in
bench_tiers.py, and the synthetic long-context trace is replayed open-loop at each rate (a fresh
token space per cell, so a cell's reuse comes from its own earlier turns). After each cell the
servers' Prometheus counters are read: SGLang's own accounting of storage-hit tokens that did not
become a usable prefix (`sglang:storage_prefetch_unfulfilled_tokens_total{reason}`: e.g.
`device_capacity` = the L2->L1 load-back found no device room, `cache_admission_shortfall` = the
L3-loaded L2 span was gone when the request was admitted) and the plugin's counters where it runs.

    python benchmarks/kv_tiers/load_diag.py --setups hicache,kv_tiers --rates 8,12 [--trace sharegpt]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats
from kllm_plugins.testing.sglang_server import start_all

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import SPACE, run_folder, setup_servers, split_setups  # noqa: E402
from replay import arrivals, assign, measure, replay_open, replay_serial  # noqa: E402
from trace_gen import generate  # noqa: E402

WATCH = ("sglang:storage_prefetch_unfulfilled_tokens_total", "sglang:storage_prefetch_deferred_tokens_total",
         "sglang:storage_prefetch_hit_tokens_total", "sglang:prefetched_tokens_total",
         "kllm_kv_tiers_prefetch_decisions_total")


def scrape(url: str) -> dict[str, float]:
    """The watched counters of one server, keyed by name and reason label."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(WATCH):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        reason = re.search(r'reason="([^"]+)"', line)
        key = name.removeprefix("sglang:") + (f"[{reason.group(1)}]" if reason else "")
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after: list[dict[str, float]], before: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for a in after for k in a}
    d = {k: sum(a.get(k, 0.0) for a in after) - sum(b.get(k, 0.0) for b in before) for k in sorted(keys)}
    return {k: v for k, v in d.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="hicache,kv_tiers")
    ap.add_argument("--rates", default="8,12")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--l1-tokens", type=int, default=3072)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", choices=("synthetic", "sharegpt"), default="synthetic",
                    help="synthetic: the long-context trace; sharegpt: bench_tiers' long ShareGPT trace "
                         "(--conversations, 1280-2560 tokens)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.trace == "sharegpt":
        from sharegpt_trace import build

        trace = build(a.conversations, max_tokens=2560, min_tokens=1280)
    else:
        trace = list(generate(a.sessions, 3, groups=a.sessions, system_blocks=64, user_blocks=12, answer_blocks=4))
    picks = assign(len(trace), 2, a.seed)
    report: list[dict[str, Any]] = []
    with run_folder("kvt-diag-run-") as run_root:  # stores kept until the end (bench_tiers.run_folder)
        for name in split_setups(a.setups):
            store = tempfile.mkdtemp(prefix=f"{name}-", dir=run_root)
            servers, plugins = setup_servers(name, store, None, "", a.l1_tokens, a.server_threads)
            for s in servers:
                s.args.append("--enable-metrics")
            urls = [s.base_url for s in servers]
            try:
                start_all(servers)
                replay_serial(urls, trace[:4], picks[:4], 0)  # warm-up in space 0
                for j, rate in enumerate(["serial", *(float(x) for x in a.rates.split(","))]):
                    for u in urls:
                        flush(u)
                    time.sleep(0.5)
                    before = [scrape(u) for u in urls]
                    space = (1 + j) * SPACE
                    if rate == "serial":
                        res, makespan = replay_serial(urls, trace, picks, space)
                    else:
                        sched = arrivals(len(trace), rate, a.seed, True)
                        res, makespan = replay_open(urls, trace, picks, sched, space)
                    time.sleep(0.6)
                    m = measure(res, makespan, 0.9)
                    row = {"setup": name, "rate": rate, "hit_rate": m["hit_rate"], "ttft_s": m["ttft_s"],
                           "throughput_req_s": m["throughput_req_s"],
                           "sglang": delta([scrape(u) for u in urls], before)}
                    if plugins:
                        row["kv_tiers"] = [kv_tiers_stats(srv) for srv in servers]
                    report.append(row)
                    h = m["hit_rate"]
                    print(f"{name} {rate}: hit {h['total']:.3f} (l2 {h['l2']:.3f} l3 {h['l3']:.3f}) TTFT p50 "
                          f"{m['ttft_s']['p50']:.3f} p90 {m['ttft_s']['p90']:.3f}, {m['throughput_req_s']:.2f} req/s; "
                          + ", ".join(f"{k} {v:.0f}" for k, v in row["sglang"].items()), flush=True)
            finally:
                for s in servers:
                    s.stop()
                os.sync()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
