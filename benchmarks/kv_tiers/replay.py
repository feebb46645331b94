"""Request-level replay for the kv_tiers benchmarks (not collected by pytest): streaming requests
against real servers, one request in flight per server (hit rate and TTFT) or an open-loop
arrival schedule (throughput and TTFT under load), and the per-cell figures. Requests are Mooncake
records (`kllm_plugins.bench.trace`), their tokens from the harness (`trace_gen.request_tokens`), sent
with the harness's streaming client."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from kllm_plugins.bench import schedule, stats
from kllm_plugins.bench.client import stream_generate
from kllm_plugins.bench.schedule import assign
from trace_gen import request_tokens

__all__ = ["arrivals", "assign", "measure", "replay_open", "replay_serial", "spread", "stream_generate"]


def arrivals(n: int, rate: float, seed: int, scaled: bool = False) -> list[float]:
    """Poisson arrival offsets (s) of `n` requests at `rate` per second: the same schedule for every
    setup (seeded by the rate and the seed). `scaled`: one unit-rate schedule per seed, divided by the
    rate, so every step of a rate ladder replays the same arrival pattern faster (the TTFT percentile
    then rises with the rate instead of also moving with each step's own draw)."""
    return schedule.poisson(n, rate, seed, scaled)


def _one(base_url: str, r: dict[str, Any], offset: int, sidx: int) -> dict[str, Any]:
    ids = request_tokens(r, offset)
    ttft, e2e, meta = stream_generate(base_url, ids, int(r["output_length"]))
    d = meta.get("cached_tokens_details") or {}
    return {"ttft_s": ttft, "e2e_s": e2e, "input": len(ids), "cached": int(meta.get("cached_tokens", 0)),
            "l1": int(d.get("device", 0)), "l2": int(d.get("host", 0)), "l3": int(d.get("storage", 0) or 0),
            "server": sidx,
            # SGLang's own measure of the wait for an L3 prefetch (servers with --enable-metrics only)
            "prefetch_wait_s": meta.get("storage_prefetch_wait")}


def replay_serial(urls: list[str], trace: list[dict[str, Any]], picks: list[int], offset: int
                  ) -> tuple[list[dict[str, Any]], float]:
    """One request in flight per server, each server taking its requests in trace order.
    Block ids are shifted by `offset` (the cell's token space). Returns (results, makespan)."""
    queues: list[list[int]] = [[i for i, s in enumerate(picks) if s == k] for k in range(len(urls))]
    results: list[dict[str, Any] | None] = [None] * len(trace)

    def worker(k: int) -> None:
        for i in queues[k]:
            results[i] = _one(urls[k], trace[i], offset, k)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for x in results if x is not None], time.perf_counter() - t0


def replay_open(urls: list[str], trace: list[dict[str, Any]], picks: list[int], offsets_s: list[float],
                offset: int) -> tuple[list[dict[str, Any]], float]:
    """Open loop: request i is sent to its server at `offsets_s[i]` whatever is in flight. Returns
    (results, makespan from the first arrival to the last completion)."""
    results: list[dict[str, Any] | None] = [None] * len(trace)
    ends: list[float] = [0.0] * len(trace)
    t0 = time.perf_counter()

    def send(i: int) -> None:
        results[i] = _one(urls[picks[i]], trace[i], offset, picks[i])
        ends[i] = time.perf_counter()

    threads = []
    for i, at in enumerate(offsets_s):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=send, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return [x for x in results if x is not None], max(ends) - t0


def measure(res: list[dict[str, Any]], makespan: float, slo_pct: float) -> dict[str, Any]:
    total_in = sum(r["input"] for r in res)
    ttfts = [r["ttft_s"] for r in res]
    hit = {k: sum(r[k] for r in res) / total_in for k in ("l1", "l2", "l3")}
    hit["total"] = sum(r["cached"] for r in res) / total_in
    return {"hit_rate": hit, "l3_hit_tokens": sum(r["l3"] for r in res),
            "ttft_s": {"mean": statistics.fmean(ttfts), "p50": stats.quantile(ttfts, 0.5),
                       "p90": stats.quantile(ttfts, slo_pct), "p99": stats.quantile(ttfts, 0.99)},
            "throughput_req_s": len(res) / makespan, "makespan_s": makespan, "requests": len(res)}


def spread(values: list[float]) -> dict[str, Any]:
    """Median with min/max, p10/p90 and the repeats (the harness's `stats.spread`)."""
    return stats.spread(values)
