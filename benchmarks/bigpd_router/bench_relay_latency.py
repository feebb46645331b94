"""Benchmark (not collected by pytest): the delay kllm-router adds to each streamed token.

The fake backend stamps every stream event with `sent_ns` (CLOCK_MONOTONIC, one clock for every
process of the machine) as it writes it; the client notes when it reads it. Per token, delivery =
received - sent, directly from the backend and through the router, in interleaved rounds (direct,
router; router, direct; ...), the same streams each time. The router's added delay per token is
the difference of the rounds' medians (and P90 / P99). Per stream, the added TPOT as
`sglang.bench_serving` defines it ((last token - first token) / (tokens - 1)) is the change of that
delay from the stream's first token to its last, over tokens - 1: the added gap between tokens.
Unlike TPOT through `sglang.bench_serving` against a real server, neither depends on the server's
step time drifting between rounds.

    python benchmarks/bigpd_router/bench_relay_latency.py --rounds 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import FAKE, router_cmd  # noqa: E402
from loadgen import free_port, py, spawn, stop, wait_http  # noqa: E402

from kllm_plugins.bench.stats import quantile, spread  # noqa: E402

PCTS = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


async def _stream(host: str, port: int, tokens: int, out: list[float], gaps: list[float]) -> int:
    """One streamed /generate over a raw connection; appends each token's delivery delay (us) to
    `out` and the stream's added gap between tokens (us: change of the delay, first to last token,
    over tokens - 1) to `gaps`."""
    body = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": tokens},
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    await writer.drain()
    seen, buf, mine = 0, b"", []
    try:
        while chunk := await reader.read(65536):
            now = time.monotonic_ns()
            buf += chunk
            while (at := buf.find(b"\n\n")) >= 0:  # an SSE event ends with a blank line
                event, buf = buf[:at], buf[at + 2:]
                i = event.find(b'"sent_ns": ')
                if i >= 0:
                    sent = int(event[i + 11:].split(b"}", 1)[0].split(b",", 1)[0])
                    mine.append((now - sent) / 1e3)
                    seen += 1
    finally:
        writer.close()
    out.extend(mine)
    if len(mine) > 1:
        gaps.append((mine[-1] - mine[0]) / (len(mine) - 1))
    return seen


async def _round(port: int, streams: int, tokens: int) -> tuple[list[float], list[float], int]:
    delays: list[float] = []
    gaps: list[float] = []
    got = await asyncio.gather(*(_stream("127.0.0.1", port, tokens, delays, gaps) for _ in range(streams)))
    return delays, gaps, sum(got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4, help="streams at once")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tpot-s", type=float, default=0.01)
    ap.add_argument("--out-name", default="relay_latency", help="benchmarks/results/bigpd_router/<name>.json")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results-root", default=None, help="write under <root>/benchmarks/results (device: $OUT)")
    ap.add_argument("--shared", default="2-core", help="what else the machine ran, for the record")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kllm-relay-lat-")
    procs = []
    try:
        bport, rport = free_port(), free_port()
        procs.append(spawn([py(), "-m", FAKE, "--port", str(bport), "--ttft-s", "0.02", "--tpot-s", str(a.tpot_s),
                            "--stamp"], f"{tmp}/fake.log"))
        wait_http(f"http://127.0.0.1:{bport}/health")
        cmd = router_cmd("kllm", rport, [f"http://127.0.0.1:{bport}"])
        assert cmd is not None
        procs.append(spawn(cmd, f"{tmp}/router.log"))
        wait_http(f"http://127.0.0.1:{rport}/health")
        targets = {"direct": bport, "router": rport}
        asyncio.run(_round(rport, a.streams, 8))  # warm-up: the router's upstream connections
        per: dict[str, dict[str, list[float]]] = {t: {k: [] for k, _ in PCTS} for t in targets}
        added: dict[str, list[float]] = {k: [] for k, _ in PCTS}
        gap: dict[str, list[float]] = {t: [] for t in targets}
        want = a.streams * a.tokens
        for rnd in range(a.rounds):
            order = list(targets) if rnd % 2 == 0 else list(targets)[::-1]
            got: dict[str, dict[str, float]] = {}
            for t in order:
                delays, gaps, n = asyncio.run(_round(targets[t], a.streams, a.tokens))
                if n != want:
                    raise SystemExit(f"round {rnd} {t}: {n} stamped events, expected {want}")
                got[t] = {k: quantile(delays, q) for k, q in PCTS}
                got[t]["gap"] = quantile(gaps, 0.5)
                gap[t].append(got[t]["gap"])
                for k, _ in PCTS:
                    per[t][k].append(got[t][k])
            for k, _ in PCTS:
                added[k].append(got["router"][k] - got["direct"][k])
            print(json.dumps({"round": rnd, **{f"{t}_{k}_us": round(v, 1) for t in got for k, v in got[t].items()}}),
                  flush=True)
    finally:
        for p in procs:
            stop(p)
    metrics = {"added_delay_us": {k: spread(v) for k, v in added.items()},
               "direct_delay_us": {k: spread(v) for k, v in per["direct"].items()},
               "router_delay_us": {k: spread(v) for k, v in per["router"].items()},
               "added_tpot_us": spread([r - d for r, d in zip(gap["router"], gap["direct"])]),
               "direct_gap_us": spread(gap["direct"]), "router_gap_us": spread(gap["router"]),
               "tokens_per_round": want}
    m = metrics["added_delay_us"]
    g = metrics["added_tpot_us"]
    print(f"delay kllm-router adds per streamed token, {a.rounds} interleaved rounds x {a.streams} streams x "
          f"{a.tokens} tokens: median {m['p50']['median']:.1f} us [{m['p50']['min']:.1f}, {m['p50']['max']:.1f}], "
          f"P90 {m['p90']['median']:.1f} us, P99 {m['p99']['median']:.1f} us (direct median "
          f"{metrics['direct_delay_us']['p50']['median']:.1f} us): a shift of every token's arrival, "
          f"counted once in TTFT, not in the gaps between tokens while it holds steady", flush=True)
    print(f"added TPOT (per stream: delay change first->last token / (tokens - 1), median of streams, "
          f"router minus direct): median {g['median']:.2f} us [{g['min']:.2f}, {g['max']:.2f}] over rounds "
          f"(target < 50 us)", flush=True)
    if not a.no_record:
        from kllm_plugins.bench.record import record

        from pathlib import Path

        record("bigpd_router", a.out_name, "python " + " ".join(sys.argv), metrics, shared=a.shared,
               root=Path(a.results_root) if a.results_root else None,
               setup={"streams": a.streams, "tokens": a.tokens, "tpot_s": a.tpot_s, "rounds": a.rounds,
                      "clock": "CLOCK_MONOTONIC (time.monotonic_ns), stamped by the fake backend as it writes"},
               notes="per round: median / P90 / P99 of each token's delivery delay, router minus direct; "
                     "spread over rounds")


if __name__ == "__main__":
    main()
