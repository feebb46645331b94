"""Where kllm-router's CPU goes when it relays streams: per request, per token, and idle.

The router (its CLI, so uvloop as in production) runs in a process of its own in front of the fake
backend (paced tokens); a light raw-socket client in this process sends streamed /generate
requests shaped like sglang.bench_serving's (input_ids, cumulative text and output_ids per event)
at a fixed concurrency. The router's CPU time (/proc) is read around each phase:

- idle: no traffic for `--idle-s` seconds (health checks, liveness probes, watchdog, loops);
- a short and a long output length (`--lengths`, e.g. 16 and 128), `--requests` requests each.

The slope of CPU per request between the two lengths is the cost per relayed token (it holds the
background work done while those tokens stream: watchdog ticks and probes, warm); "less idle"
also takes off the idle rate over the phases' time (an over-estimate of the background under load,
where wake-ups are cheaper); the intercept is the cost per request. "all / tokens" is what the
bench_serving benchmark used to report: all of the router's CPU over the tokens it relayed.
`--tree PATH` (repeatable) runs other checkouts' router code beside this one, in rotating order per
round; `--profile FILE` runs the first router under cProfile (slower: to see where, not how much).

    python benchmarks/bigpd_router/relay_cpu.py --tree '' --tree /tmp/router-base --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_overhead import FAKE, cpu_ns, cpu_user_system, med  # noqa: E402
from loadgen import free_port, py, spawn, stop, wait_http  # noqa: E402

BOOT = """
import sys
tree, prof = sys.argv.pop(1), sys.argv.pop(1)
if tree:
    import kllm_plugins.plugins as p
    p.__path__[:] = [tree + '/plugins']
from kllm_plugins.plugins.bigpd_router.service.cli import main
if prof:
    import cProfile
    cProfile.run('main()', prof)
else:
    main()
"""


def cpu_mark(pid: int) -> tuple[int, float, float]:
    return (cpu_ns(pid), *cpu_user_system(pid))


def cpu_since(pid: int, before: tuple[int, float, float]) -> tuple[float, float, float]:
    """(total, user, system) CPU seconds since `before`; the total from schedstat, the split from the ticks."""
    ns, u, s = cpu_mark(pid)
    return (ns - before[0]) / 1e9, u - before[1], s - before[2]


async def one(host: str, port: int, body: bytes, conn: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> int:
    """One streamed request on the worker's keep-alive connection; returns the events received."""
    if not conn:
        conn.append(await asyncio.open_connection(host, port))
    reader, writer = conn[0]
    writer.write(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert b"chunked" in head.lower(), head
    parts = []
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("router closed mid-stream")
        parts.append(data)
        if data.endswith(b"0\r\n\r\n") and b"".join(parts[-2:]).endswith(b"\r\n0\r\n\r\n"):
            break
    raw = b"".join(parts)
    return raw.count(b"data: {")


async def phase(host: str, port: int, length: int, requests: int, concurrency: int, prompt_len: int) -> int:
    rng = random.Random(length)
    bodies = [json.dumps({"input_ids": [rng.randrange(1, 500) for _ in range(prompt_len)],
                          "sampling_params": {"temperature": 0.0, "max_new_tokens": length, "ignore_eos": True},
                          "stream": True, "lora_path": None, "return_logprob": False,
                          "logprob_start_len": -1}).encode() for _ in range(requests)]
    todo = list(range(requests))
    events = 0

    async def worker() -> None:
        nonlocal events
        conn: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        while todo:
            n = await one(host, port, bodies[todo.pop()], conn)
            events += n
        if conn:
            conn[0][1].close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return events


def tcp_relay(port: int, upstream_port: int) -> None:
    """The floor: a bare TCP relay on uvloop (each client connection piped to its own upstream
    connection, bytes forwarded as they come, no HTTP at all), run as `--floor`'s target."""
    import uvloop

    class Pipe(asyncio.Protocol):
        def __init__(self) -> None:
            self.peer: asyncio.Transport | None = None
            self.pending: list[bytes] = []

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            if self.peer is None:
                self.pending.append(data)
            else:
                self.peer.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.peer is not None:
                self.peer.close()

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        async def accepted(client: Pipe) -> None:
            _, up = await loop.create_connection(Pipe, "127.0.0.1", upstream_port)
            up.peer, client.peer = client.transport, up.transport
            for d in client.pending:
                up.transport.write(d)

        def factory() -> Pipe:
            p = Pipe()
            orig = p.connection_made

            def made(t: asyncio.BaseTransport) -> None:
                orig(t)
                loop.create_task(accepted(p))
            p.connection_made = made  # type: ignore[method-assign]
            return p

        server = await loop.create_server(factory, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-floor":
        return tcp_relay(int(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/kllm-plugins/tiny-llama-v2"),
                    help="model folder the fake backend reports (the router learns the vocabulary from it)")
    ap.add_argument("--lengths", type=int, nargs=2, default=[16, 128], metavar=("SHORT", "LONG"))
    ap.add_argument("--requests", type=int, nargs=2, default=[64, 24], metavar=("SHORT", "LONG"),
                    help="requests per phase, for each length")
    ap.add_argument("--rounds", type=int, default=1, help="rounds (medians over them; the order rotates)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tpot-s", type=float, default=0.01)
    ap.add_argument("--ttft-s", type=float, default=0.02)
    ap.add_argument("--idle-s", type=float, default=4.0, help="idle window per round (all routers at once)")
    ap.add_argument("--tree", action="append", default=[],
                    help="also run this checkout's router code (repeatable; '' is this checkout, the default)")
    ap.add_argument("--floor", action="store_true",
                    help="also run a bare TCP relay on uvloop (no HTTP): the cost of the sockets and the loop alone")
    ap.add_argument("--profile", default="", help="cProfile the (first) router into this file")
    ap.add_argument("--router-arg", action="append", default=[], help="extra kllm-router argument (repeatable)")
    args = ap.parse_args()
    trees = args.tree or [""]
    tmp = tempfile.mkdtemp(prefix="kllm-relay-cpu-")
    bport = free_port()
    procs = [spawn([py(), "-m", FAKE, "--port", str(bport), "--ttft-s", str(args.ttft_s), "--tpot-s",
                    str(args.tpot_s), "--model-info-path", args.model], f"{tmp}/fake.log")]
    routers: list[tuple[str, int, int]] = []  # name, port, pid
    per: dict[str, dict[str, list[float]]] = {}
    try:
        wait_http(f"http://127.0.0.1:{bport}/health")
        for k, tree in enumerate(trees):
            rport = free_port()
            prof = os.path.abspath(args.profile) if args.profile and k == 0 else ""
            cmd = [py(), "-c", BOOT, tree, prof, "--port", str(rport), "--worker", f"http://127.0.0.1:{bport}",
                   "--policy", "round_robin", "--log-level", "WARNING", "--loads-interval-s", "0", *args.router_arg]
            proc = spawn(cmd, f"{tmp}/router-{k}.log")
            procs.append(proc)
            routers.append((tree or "this checkout", rport, proc.pid))
        if args.floor:
            rport = free_port()
            proc = spawn([py(), os.path.abspath(__file__), "--serve-floor", str(rport), str(bport)],
                         f"{tmp}/floor.log")
            procs.append(proc)
            routers.append(("bare TCP relay (floor)", rport, proc.pid))
        for name, rport, _ in routers:
            wait_http(f"http://127.0.0.1:{rport}/health")
            asyncio.run(phase("127.0.0.1", rport, 4, 8, args.concurrency, args.prompt_len))  # warm-up
            per[name] = {"idle": [], "short": [], "long": [], "bench": [], "slope": [], "slope_less_idle": [],
                         "request": []}
        (l1, l2), (r1, r2) = args.lengths, args.requests
        for rnd in range(args.rounds):
            time.sleep(0.5)
            marks = [(cpu_mark(pid), time.monotonic()) for _, _, pid in routers]
            time.sleep(args.idle_s)
            idle = {name: cpu_since(pid, m[0])[0] / (time.monotonic() - m[1])
                    for (name, _, pid), m in zip(routers, marks)}
            k = rnd % len(routers)
            for name, rport, pid in routers[k:] + routers[:k]:
                got = []
                for length, nreq in ((l1, r1), (l2, r2)):
                    c0, t0 = cpu_mark(pid), time.monotonic()
                    events = asyncio.run(phase("127.0.0.1", rport, length, nreq, args.concurrency, args.prompt_len))
                    (cpu, user, system), wall = cpu_since(pid, c0), time.monotonic() - t0
                    assert events == length * nreq, (events, length * nreq)
                    got.append((cpu, wall, user, system))
                (c1, w1, _, _), (c2, w2, u2, s2) = got
                slope = (c2 / r2 - c1 / r1) / (l2 - l1)
                less = ((c2 - idle[name] * w2) / r2 - (c1 - idle[name] * w1) / r1) / (l2 - l1)
                row = per[name]
                row["idle"].append(idle[name] * 1e3)
                row["short"].append(c1 * 1e6 / (l1 * r1))
                row["long"].append(c2 * 1e6 / (l2 * r2))
                row["bench"].append((c1 + c2) * 1e6 / (l1 * r1 + l2 * r2))
                row["slope"].append(slope * 1e6)
                row["slope_less_idle"].append(less * 1e6)
                row["request"].append((c1 / r1 - slope * l1) * 1e6)
                print(f"round {rnd} {name}: idle {idle[name] * 1e3:.2f} ms/s; all CPU / tokens {l1} tok "
                      f"{c1 * 1e6 / (l1 * r1):.1f}, {l2} tok {c2 * 1e6 / (l2 * r2):.1f} us/token (user/system "
                      f"{u2 * 1e3:.0f}/{s2 * 1e3:.0f} ms); slope {slope * 1e6:.1f} us/token ({less * 1e6:.1f} less "
                      f"idle), {(c1 / r1 - slope * l1) * 1e6:.0f} us/request", flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
    print(f"\nmedians over {args.rounds} round(s); us per token unless said")
    print(f"{'router':<28} {'idle ms/s':>9} {'all/tok ' + str(l1):>11} {'all/tok ' + str(l2):>11} "
          f"{'slope':>7} {'less idle':>9} {'us/request':>10}")
    for name, row in per.items():
        print(f"{name[-28:]:<28} {med(row['idle']):>9.2f} {med(row['short']):>11.1f} {med(row['long']):>11.1f} "
              f"{med(row['slope']):>7.1f} {med(row['slope_less_idle']):>9.1f} {med(row['request']):>10.0f}")
    if args.profile:
        import pstats

        st = pstats.Stats(os.path.abspath(args.profile))
        st.sort_stats("tottime").print_stats(30)
    print(f"logs in {tmp}")


if __name__ == "__main__":
    main()
