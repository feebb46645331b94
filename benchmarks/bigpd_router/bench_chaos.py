"""Chaos benchmark of kllm-router: what clients see when instances die, freeze or are poisoned and
when clients misbehave. Loopback only, fake SGLang backends (separate processes), fixed budgets.

Each scenario starts three fresh fake backends (`fake_backend`, 40-token streams at 20 ms per
token, a /model_info whose model folder gives a 1000-token vocabulary, and a request holding token
id 99999999 kills the process that gets it, as it kills SGLang's scheduler) and a fresh router
(`kllm-router`, uvloop, default options), sends a fixed budget of streaming requests at fixed
concurrency, and injects one fault once `--fault-after` requests have completed:

- kill9: SIGKILL of backend 0;          - sigstop: SIGSTOP of backend 0 (SIGCONT at the end);
- poison: one `{"input_ids": [99999999]}` request; - slowloris: 100 connections sending a request
  head one byte a second; - resets: 100 clients that start a stream and reset the connection.

Every request has the scenario's time bound; one that has not ended by then is "hung". A request
is "completed" (200, [DONE], no error event) or a "clean error" (an error status or event).
Detection is the time from the fault until the router's /admin/instances shows backend 0 down.
`--baseline-tree DIR` runs the same scenarios against the router code of another checkout (for
example `git worktree add /tmp/old <commit>`), side by side with this one.

    python benchmarks/bigpd_router/bench_chaos.py --budget 80 --concurrency 12 --bound-s 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(__file__))
from loadgen import free_port, py, spawn, stop, wait_http  # noqa: E402

from kllm_plugins.bench.client import astream  # noqa: E402
from kllm_plugins.bench.record import build_summary, result_path, write_summary  # noqa: E402

FAKE = "kllm_plugins.plugins.bigpd_router.service.fake_backend"
SCENARIOS = ("kill9", "sigstop", "poison", "slowloris", "resets")
POISON = {"input_ids": [99999999], "stream": True, "sampling_params": {"max_new_tokens": 4}}


def router_cmd(port: int, workers: list[str], tree: str | None) -> list[str]:
    args = ["--port", str(port), "--log-level", "INFO", "--log-format", "text", "--loads-interval-s", "0"]
    for w in workers:
        args += ["--worker", w]
    if tree is None:
        return [py(), "-m", "kllm_plugins.plugins.bigpd_router.service.cli", *args]
    boot = ("import sys, kllm_plugins.plugins as p; p.__path__[:] = [sys.argv.pop(1) + '/plugins']; "
            "from kllm_plugins.plugins.bigpd_router.service.cli import main; main()")
    return [py(), "-c", boot, tree, *args]


ERRORS: list[str] = []
"""The first error answers of a scenario (what a client was told)."""


async def stream_one(s: aiohttp.ClientSession, url: str, i: int, bound_s: float) -> str:
    body = {"text": f"chaos request {i}", "stream": True, "sampling_params": {"max_new_tokens": 40}}
    try:
        async with asyncio.timeout(bound_s):
            r = await astream(s, url + "/generate", body, meta=False)
    except TimeoutError:
        return "hung"
    if r.broken:
        ERRORS.append(r.error)
        return "error"  # the connection was closed on the client: an answer, if not a polite one
    if not r.ok or not r.done:
        ERRORS.append(r.error or f"{r.status} stream ended without [DONE]")
        return "error"
    return "completed"


async def instance_down(s: aiohttp.ClientSession, rurl: str, url: str) -> bool:
    try:
        async with s.get(rurl + "/admin/instances", timeout=aiohttp.ClientTimeout(total=2)) as r:
            insts = (await r.json())["instances"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return False
    return any(i["url"] == url and i["health"] != "healthy" for i in insts)


async def slowloris(port: int, n: int, until: float) -> dict[str, int]:
    """n connections that send a request head one byte a second; how many the router closed."""
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nX-Pad: " + b"a" * 200
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    closed = [False] * n
    pos = 0
    loop = asyncio.get_running_loop()
    while loop.time() < until and not all(closed):
        for k, (reader, writer) in enumerate(conns):
            if closed[k]:
                continue
            if reader.at_eof() or writer.is_closing():
                closed[k] = True
                continue
            try:
                writer.write(head[pos % len(head):pos % len(head) + 1])
                await writer.drain()
            except (ConnectionError, RuntimeError):
                closed[k] = True
        for k, (reader, _) in enumerate(conns):
            if not closed[k]:
                try:
                    data = await asyncio.wait_for(reader.read(1024), 0.01)
                    closed[k] = closed[k] or data == b"" or data.startswith(b"HTTP/1.1 408")
                except (asyncio.TimeoutError, ConnectionError):
                    pass
        pos += 1
        await asyncio.sleep(1.0)
    for _, w in conns:
        w.close()
    return {"slowloris_sent": n, "slowloris_closed_by_router": sum(closed)}


def reset_storm(port: int, n: int) -> int:
    data = json.dumps({"text": "reset me", "stream": True, "sampling_params": {"max_new_tokens": 40}}).encode()
    req = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
           "\r\n\r\n").encode() + data
    socks = []
    for _ in range(n):
        sk = socket.create_connection(("127.0.0.1", port))
        sk.sendall(req)
        socks.append(sk)
    time.sleep(0.3)
    for sk in socks:
        sk.settimeout(5)
        try:
            sk.recv(64)
        except OSError:
            pass
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sk.close()
    return n


async def scenario(name: str, rurl: str, port: int, backends: list[subprocess.Popen[bytes]], urls: list[str],
                   args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": name}
    ERRORS.clear()
    loop = asyncio.get_running_loop()
    t_start = loop.time()
    bound = args.bound_s
    results: list[str] = []
    done = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        sem = asyncio.Semaphore(args.concurrency)

        async def worker(i: int) -> None:
            async with sem:
                results.append(await stream_one(s, rurl, i, max(1.0, t_start + bound - loop.time())))
                if sum(r == "completed" for r in results) >= args.fault_after:
                    done.set()

        tasks = [asyncio.create_task(worker(i)) for i in range(args.budget)]
        try:
            await asyncio.wait_for(done.wait(), bound)
        except asyncio.TimeoutError:
            pass
        t_fault = time.monotonic()
        side: Any = None
        if name == "kill9":
            os.killpg(backends[0].pid, signal.SIGKILL)
        elif name == "sigstop":
            os.kill(backends[0].pid, signal.SIGSTOP)
        elif name == "poison":
            async with s.post(rurl + "/generate", json=POISON, timeout=aiohttp.ClientTimeout(total=bound)) as r:
                out["poison_status"] = r.status
                out["poison_answer"] = (await r.read())[:160].decode(errors="replace")
        elif name == "slowloris":
            side = asyncio.create_task(slowloris(port, 100, t_start + bound - 1.0))
        elif name == "resets":
            out["resets_sent"] = await asyncio.to_thread(reset_storm, port, 100)
        if name in ("kill9", "sigstop"):
            detect = None
            while time.monotonic() - t_fault < bound:
                if await instance_down(s, rurl, urls[0]):
                    detect = time.monotonic() - t_fault
                    break
                await asyncio.sleep(0.05)
            out["detect_s"] = round(detect, 2) if detect is not None else None
        await asyncio.gather(*tasks)
        if side is not None:
            out.update(await side)
        # after the storm: the router still serves, and holds nothing for the requests that ended
        out["after"] = await stream_one(s, rurl, 10_000, 20.0)
        try:
            async with s.get(rurl + "/admin/instances", timeout=aiohttp.ClientTimeout(total=5)) as r:
                out["in_flight_after"] = sum(i["in_flight"] for i in (await r.json())["instances"])
        except (aiohttp.ClientError, asyncio.TimeoutError):
            out["in_flight_after"] = None
    if name == "sigstop":
        os.kill(backends[0].pid, signal.SIGCONT)
    out.update({k: results.count(k) for k in ("completed", "error", "hung")})
    out["backends_dead"] = sum(1 for b in backends if b.poll() is not None) + sum(
        1 for u in urls[1:] if not _alive(u))
    out["wall_s"] = round(loop.time() - t_start, 2)
    out["errors_seen"] = sorted(set(ERRORS))[:4]
    return out


def _alive(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_one(name: str, tree: str | None, tmp: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    backends, urls = [], []
    for i in range(3):
        port = free_port()
        backends.append(spawn([py(), "-m", FAKE, "--port", str(port), "--tpot-s", "0.02", "--crash-on", "99999999",
                               "--model-info-path", model_dir], f"{tmp}/{name}-fake{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    rport = free_port()
    log = f"{tmp}/{name}-{'baseline' if tree else 'kllm'}-router.log"
    router = spawn(router_cmd(rport, urls, tree), log)
    try:
        for u in urls:
            wait_http(u + "/health")
        wait_http(f"http://127.0.0.1:{rport}/health", 60)
        res = asyncio.run(scenario(name, f"http://127.0.0.1:{rport}", rport, backends, urls, args))
    finally:
        stop(router)
        for b in backends:
            try:
                os.kill(b.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop(b)
    with open(log, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    res["router_tracebacks"] = text.count("Traceback")
    res["router"] = "baseline" if tree else "kllm"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--budget", type=int, default=80, help="streaming requests per scenario")
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--fault-after", type=int, default=20, help="completed requests before the fault")
    ap.add_argument("--bound-s", type=float, default=40.0, help="time bound of each request and scenario")
    ap.add_argument("--baseline-tree", help="a checkout whose router code runs the same scenarios")
    ap.add_argument("--out", default=str(result_path("bigpd_router", "chaos")),
                    help="the result summary (default benchmarks/results/bigpd_router/chaos.json)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kllm-chaos-")
    model_dir = os.path.join(tmp, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump({"vocab_size": 1000}, fh)
    load_before = os.getloadavg()
    rows = []
    for name in args.scenarios:
        for tree in ([args.baseline_tree] if args.baseline_tree else []) + [None]:
            row = run_one(name, tree, tmp, model_dir, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    load_after = os.getloadavg()
    print("\nrouter    scenario   completed  clean_err  hung  detect_s  backends_dead  tracebacks  extra")
    for r in rows:
        extra = {k: r[k] for k in ("poison_status", "slowloris_closed_by_router", "in_flight_after", "after")
                 if k in r}
        print(f"{r['router']:<9} {r['scenario']:<10} {r['completed']:>9}  {r['error']:>9}  {r['hung']:>4}  "
              f"{str(r.get('detect_s', '-')):>8}  {r['backends_dead']:>13}  {r['router_tracebacks']:>10}  {extra}")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    if args.no_record:
        return
    metrics: dict[str, Any] = {}
    for r in rows:  # per router and scenario: what the clients got
        metrics.setdefault(r["router"], {})[r["scenario"]] = {
            k: r[k] for k in ("completed", "error", "hung", "detect_s", "backends_dead", "router_tracebacks") if k in r}
    summary = build_summary(" ".join(["python", *sys.argv]), metrics,
                            shared=f"shared with other work (load average {load_before[0]:.1f} before, "
                                   f"{load_after[0]:.1f} after); loopback; fake backends",
                            baseline_tree=args.baseline_tree, budget=args.budget, concurrency=args.concurrency,
                            bound_s=args.bound_s, rows=rows)
    print(f"recorded {write_summary(args.out, summary)}")


if __name__ == "__main__":
    main()
