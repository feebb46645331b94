"""GPU row of bigpd_router: the latency kllm-router adds in front of one SGLang instance on the
GPU (kllm_cuda, 8B-shaped random bf16 model, CUDA graphs on), direct vs through the router,
interleaved per round (direct, router; router, direct; ...), the same prompts for both in a round.

The client is the streaming `/generate` client of benchmarks/fair_sched/serving.py (TTFT, TPOT and
latency per request; `sglang.bench_serving` is not in the trimmed wheel the device call carries).
Two loads per round: `--serial` requests one after the other and a burst of `--burst` requests at
once. Added = router minus direct of the round's medians; spread over rounds.

    python benchmarks/gpu/router_overhead_gpu.py --rounds 3 --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fair_sched"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bigpd_router"))
from gpu_bench_common import Setup, header, log, spread, write  # noqa: E402
from loadgen import free_port, py, spawn, stop, wait_http  # noqa: E402
from serving import Job, run_jobs  # noqa: E402


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(url: str, jobs: list[Job], concurrent: bool) -> dict[str, float]:
    outs = run_jobs(url, jobs) if concurrent else [run_jobs(url, [j])[0] for j in jobs]
    assert all(o.output_len == jobs[0].max_new_tokens for o in outs), [o.output_len for o in outs]
    return {"median_ttft_ms": 1e3 * med([o.ttft_s for o in outs]), "median_tpot_ms": 1e3 * med([o.tpot_s for o in outs]),
            "median_e2e_ms": 1e3 * med([o.latency_s for o in outs])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serial", type=int, default=12)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    setup = Setup(a.cpu_dry_run)
    res = header("benchmarks/gpu/router_overhead_gpu.py", "python " + " ".join(sys.argv), setup,
                 {"rounds": a.rounds, "serial_requests": a.serial, "burst_requests": a.burst, "input_len": a.input_len,
                  "output_len": a.output_len, "router": "kllm-router --policy round_robin, one worker",
                  "client": "streaming /generate (benchmarks/fair_sched/serving.py)"})
    srv = setup.server([], ["--chunked-prefill-size", "8192"], {}, max(16384, (a.burst + 4) * (a.input_len + a.output_len)),
                       a.mem_fraction, graphs=True, strict=False)
    tmp = tempfile.mkdtemp(prefix="kllm-router-gpu-")
    router = None
    rows: list[dict[str, Any]] = []
    try:
        srv.start()
        rport = free_port()
        router = spawn([py(), "-m", "kllm_plugins.plugins.bigpd_router.service.cli", "--port", str(rport), "--policy",
                        "round_robin", "--log-level", "WARNING", "--loads-interval-s", "0", "--worker", srv.base_url],
                       f"{tmp}/router.log")
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl + "/health", 60)
        targets = [("direct", srv.base_url), ("router", rurl)]

        def jobs(tag: str, n: int) -> list[Job]:
            rng = random.Random(tag)
            return [Job(f"{tag}-{i}", 0.0, [rng.randrange(10, setup.vocab - 10) for _ in range(a.input_len)],
                        a.output_len, "short") for i in range(n)]

        for name, url in targets:  # warm-up: graphs, Triton, connections
            measure(url, jobs(f"warm-{name}", 8), True)
        for rnd in range(a.rounds):
            for name, url in (targets if rnd % 2 == 0 else targets[::-1]):
                for load, n, conc in (("serial", a.serial, False), ("burst", a.burst, True)):
                    row = {"round": rnd, "target": name, "load": load,
                           **measure(url, jobs(f"r{rnd}-{load}", n), conc)}  # same prompts for both targets
                    rows.append(row)
                    log("router", str(row))
                    res["rows"] = rows
                    write(a.out, res)
    finally:
        if router is not None:
            stop(router)
        srv.stop()
    metrics: dict[str, Any] = {}
    for load in ("serial", "burst"):
        by = {(r["round"], r["target"]): r for r in rows if r["load"] == load}
        pairs = [(by[(k, "router")], by[(k, "direct")]) for k in range(a.rounds) if (k, "router") in by and (k, "direct") in by]
        if not pairs:
            continue
        cell: dict[str, Any] = {}
        for key in ("median_ttft_ms", "median_tpot_ms", "median_e2e_ms"):
            cell[f"direct_{key}"] = spread([d[key] for _, d in pairs])
            cell[f"router_{key}"] = spread([r[key] for r, _ in pairs])
            cell[f"added_{key}"] = spread([r[key] - d[key] for r, d in pairs])
            cell[f"ratio_{key}"] = spread([r[key] / max(d[key], 1e-9) for r, d in pairs])
        metrics[load] = cell
        log("router", f"{load}: added median TTFT {cell['added_median_ttft_ms']['median']:.2f} ms, TPOT "
            f"{cell['added_median_tpot_ms']['median']:.3f} ms, E2E ratio {cell['ratio_median_e2e_ms']['median']:.3f}")
    res["metrics"] = metrics
    write(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
