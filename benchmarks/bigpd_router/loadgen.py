"""Benchmark helper: open-loop and closed-loop HTTP load generators and process helpers.

Requests go through the harness's streaming client (`kllm_plugins.bench.client.astream`), arrivals
come from its schedules (`kllm_plugins.bench.schedule`), quantiles from its stats
(`numpy.percentile`-compatible), and the combined results file
(`benchmarks/results/bigpd_router/summary.json`) is written by its recorder."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Sequence

import aiohttp

from kllm_plugins.bench import schedule, stats
from kllm_plugins.bench.client import astream
from kllm_plugins.bench.record import load_summary, result_path, update_sections


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: Sequence[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out = open(log_path, "wb")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def quantile(xs: list[float], q: float) -> float:
    """The harness's quantile (numpy.percentile-compatible); NaN for no samples."""
    return stats.quantile(xs, q) if xs else float("nan")


async def one(s: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> tuple[float, float, bool]:
    """(ttft, total) seconds and success for one request, read by the harness's client."""
    r = await astream(s, url, body, meta=False)
    if r.broken:
        return float("nan"), float("nan"), False
    return r.ttft_s, r.e2e_s, r.status == 200


async def open_loop(url: str, body: dict[str, Any], rate: float, duration_s: float,
                    stream: bool = False) -> dict[str, Any]:
    """Poisson-free fixed-interval arrivals at `rate` for `duration_s`; latencies of all requests."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        tasks = []
        t0 = time.perf_counter()
        n = int(rate * duration_s)
        for at in schedule.constant(n, rate):
            target = t0 + at
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, url, body, stream)))
        res = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    lat = [t for _, t, ok in res if ok]
    return {"n": n, "ok": len(lat), "achieved_rps": len(lat) / elapsed, "p50": quantile(lat, 0.5),
            "p99": quantile(lat, 0.99)}


async def closed_loop(url: str, body: dict[str, Any], concurrency: int, duration_s: float) -> float:
    """Completed requests per second with `concurrency` clients looping for `duration_s`."""
    done = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        end = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                _, _, ok = await one(s, url, body, False)
                done += ok

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def py() -> str:
    return sys.executable


SUMMARY = ("bigpd_router", "summary")  # benchmarks/results/bigpd_router/summary.json


def merge_results(key: str, rows: list[dict[str, Any]], command: str, keep: Any = None,
                  command_key: str | None = None) -> None:
    """Put one part (overhead, scaling, routing, ...) into the plugin's combined results file,
    `benchmarks/results/bigpd_router/summary.json`, through the harness's recorder.
    `keep(row)`: rows of the part already there that stay (e.g. the simulated ones when the
    real-server run writes its own into the same "scaling" list). `rows` may also be a dict (a
    part that is one object)."""
    path = result_path(*SUMMARY)
    data: dict[str, Any] = load_summary(path) if path.exists() else {}
    if command_key is None:
        command_key = key if keep is None else f"{key}:{rows[0].get('simulated') if rows else ''}"
    old = data.get(key, [])
    if isinstance(rows, list):
        part: Any = ([r for r in old if keep(r)] if keep and isinstance(old, list) else []) + rows
    else:
        part = rows
    update_sections(path, command_key, command, {key: part},
                    shared="shared 2-core, several helpers; benchmarks under flock")
