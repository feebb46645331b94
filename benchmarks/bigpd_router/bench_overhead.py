"""Router overhead: latency the router adds over talking to a backend directly, and max rate.

Two fake SGLang backends that answer at once (kllm_plugins...service.fake_backend, no model
path reported), then for each router (kllm-router, smg if installed, sglang-router if
installed) the same open-loop load at each rate, plain and streaming, plus a closed-loop max
rate. Added latency = router quantile - direct quantile at the same rate, from the same run.
Client, routers and backends share this machine's cores: absolute numbers are machine-bound.

    python benchmarks/bigpd_router/bench_overhead.py --rates 200 500 --duration-s 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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
    exe = shutil.which(name if name == "smg" else "sglang-router") or (
        os.path.join(os.path.dirname(py()), name) if os.path.exists(os.path.join(os.path.dirname(py()), name)) else None)
    if name == "smg" and exe:
        return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--worker-urls", *workers]
    if name == "sglang-router":
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            return None
        return [py(), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--worker-urls", *workers]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", type=float, nargs="+", default=[200.0, 500.0])
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--routers", nargs="+", default=["kllm", "smg", "sglang-router"])
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kllm-bench-")
    backends = []
    urls = []
    for i in range(2):
        port = free_port()
        backends.append(spawn([py(), "-m", FAKE, "--port", str(port)], f"{tmp}/fake{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health")
    body_plain = {"text": "hello " * 20, "sampling_params": {"max_new_tokens": 4}}
    body_stream = dict(body_plain, stream=True)
    rows: list[dict[str, Any]] = []
    try:
        direct = {}
        for rate in args.rates:
            for stream, body in ((False, body_plain), (True, body_stream)):
                direct[(rate, stream)] = asyncio.run(open_loop(urls[0] + "/generate", body, rate,
                                                               args.duration_s, stream))
        for name in args.routers:
            port = free_port()
            cmd = router_cmd(name, port, urls)
            if cmd is None:
                print(f"{name}: not installed, skipped")
                continue
            proc = spawn(cmd, f"{tmp}/{name}.log")
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 60)
                url = f"http://127.0.0.1:{port}/generate"
                asyncio.run(open_loop(url, body_plain, 50, 1.0))  # warm-up
                max_rps = asyncio.run(closed_loop(url, body_plain, args.concurrency, args.duration_s))
                for rate in args.rates:
                    for stream, body in ((False, body_plain), (True, body_stream)):
                        r = asyncio.run(open_loop(url, body, rate, args.duration_s, stream))
                        d = direct[(rate, stream)]
                        row = {"router": name, "rate_rps": rate, "stream": stream,
                               "achieved_rps": round(r["achieved_rps"], 1), "ok": r["ok"], "n": r["n"],
                               "added_ms": {"p50": round((r["p50"] - d["p50"]) * 1000, 3),
                                            "p99": round((r["p99"] - d["p99"]) * 1000, 3)},
                               "router_ms": {"p50": round(r["p50"] * 1000, 3), "p99": round(r["p99"] * 1000, 3)},
                               "direct_ms": {"p50": round(d["p50"] * 1000, 3), "p99": round(d["p99"] * 1000, 3)},
                               "max_rps": round(max_rps, 1)}
                        rows.append(row)
                        print(json.dumps(row))
            finally:
                stop(proc)
    finally:
        for b in backends:
            stop(b)
    print("\nrouter      rate  stream  added p50 ms  added p99 ms  max rps")
    for r in rows:
        print(f"{r['router']:<12}{r['rate_rps']:>5.0f}  {str(r['stream']):<6}  {r['added_ms']['p50']:>12.3f}  "
              f"{r['added_ms']['p99']:>12.3f}  {r['max_rps']:>7.0f}")
    kllm = [r for r in rows if r["router"] == "kllm"]
    smg = {(r["rate_rps"], r["stream"]): r for r in rows if r["router"] == "smg"}
    for r in kllm:
        s = smg.get((r["rate_rps"], r["stream"]))
        if s and s["added_ms"]["p99"] > 0:
            print(f"rate {r['rate_rps']:.0f} stream={r['stream']}: kllm/smg added-P99 ratio "
                  f"{r['added_ms']['p99'] / s['added_ms']['p99']:.2f}")
    merge_results("overhead", rows, " ".join(["python", *sys.argv]))


if __name__ == "__main__":
    main()
