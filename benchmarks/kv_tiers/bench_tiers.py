"""Replay shared-prefix multi-turn traces against two real SGLang servers per setup on CPU: L1 only
vs stock HiCache (L2 + SGLang's file L3) vs kv_tiers (L2 + checked file L3, fetch-or-recompute,
selective writes under pressure), the L3 folder shared by a setup's two servers.

Sizes, the same for every setup: L1 (device KV) `--l1-tokens` per server; L2 (host) `--hicache-ratio`
2 = 2x L1 per server; L3 a folder shared by the two servers, unbounded for stock HiCache (SGLang's
file backend has no bound) and `store_capacity_gb` (16 GiB, never reached here) for kv_tiers.

Setups are interleaved: repeat 1 runs them in the order A B C, repeat 2 C B A (and so on), so a
drift of the shared machine hits every setup alike; a setup's two servers start fresh for each of
its turns (consecutive turns of one setup share a start). Six servers at once do not fit: SGLang
refuses a host pool while less than 10 GiB of the machine is free. Each measurement cell
(repeat, trace, load step) uses its own token space (fresh block ids, the same in every setup)
and starts with L1 and L2 flushed, so nothing carries over from an earlier cell (L3 keeps old
pages, which no later cell can match).

A request goes to a server picked by a seeded coin (a load balancer that knows nothing of
prefixes; the same picks in every setup), so about half of a conversation's turns land on the
other server: there only a shared L3 can serve its prefix. Traces: synthetic (trace_gen, Mooncake
format), ShareGPT-derived (sharegpt_trace, real multi-turn conversations) and a no-reuse control.

Measured per setup and trace:
- hit rate per tier from SGLang's per-request breakdown (`cached_tokens_details`: device = L1,
  host = L2, storage = L3), at load step 1 (deterministic: one request in flight per server);
- TTFT mean/P50/P99 at load step 1 (streaming, first chunk): median over repeats, and per repeat;
- throughput at the TTFT SLO, by a closed-loop load ladder: `--concurrency` requests in flight
  per server (e.g. 1, 2, 4); at each step the completed requests per second and the TTFT P90;
  the throughput at SLO is the highest step throughput whose TTFT P90 is within the SLO (0 if
  none). A closed loop cannot overload the servers (no queue blow-up that makes an open-loop
  rate sweep on 2 shared cores flip between runs), and the step throughput is what the servers
  actually sustained. Median over repeats, and per repeat.
Prints the setups side by side with ratios, writes benchmarks/results/kv_tiers.json and appends a
row to benchmarks/RESULTS.md.

Stock HiCache needs kv_tiers' CPU compatibility hooks (unpinned host pool, torch direct copy) to
run on this platform at all, so its setup loads the plugin with the policies off
(adaptive_thresholds=false) and SGLang's own `file` backend.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.kv_tiers import flush, kv_tiers_stats, l3_args
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

sys.path.insert(0, str(Path(__file__).parent))
from trace_gen import generate, tokens_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPACE = 1 << 24  # block ids per token space (one space per measurement cell)


def setup_args(name: str, store: str) -> tuple[list[str], list[str], dict[str, str]]:
    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls"}
    if name == "l1_only":
        return [], [], {}
    if name == "hicache":
        env.update({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": store, "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "false"})
        return l3_args("file"), ["kv_tiers"], env
    env.update({"KLLM_KV_TIERS_STORE_DIR": store})
    return l3_args("kllm_file"), ["kv_tiers"], env


def stream_generate(base_url: str, ids: list[int], max_new_tokens: int) -> tuple[float, float, dict[str, Any]]:
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    return ttft or float("nan"), time.perf_counter() - t0, last.get("meta_info", {})


def assign(n: int, servers: int, seed: int) -> list[int]:
    """The server of each request: a seeded coin, the same for every setup and load step."""
    rng = random.Random(seed)
    return [rng.randrange(servers) for _ in range(n)]


def replay(servers: list[SGLangServer], trace: list[dict[str, Any]], picks: list[int], concurrency: int,
           offset: int) -> list[dict[str, Any]]:
    """Closed loop: `concurrency` requests in flight per server, each server taking its requests in
    trace order. Block ids are shifted by `offset` (the cell's token space)."""
    queues: list[list[int]] = [[] for _ in servers]
    for i, s in enumerate(picks):
        queues[s].append(i)
    results: list[dict[str, Any] | None] = [None] * len(trace)
    lock = threading.Lock()

    def worker(sidx: int) -> None:
        while True:
            with lock:
                if not queues[sidx]:
                    return
                i = queues[sidx].pop(0)
            r = trace[i]
            ids = tokens_for([h + offset for h in r["hash_ids"]])
            ttft, e2e, meta = stream_generate(servers[sidx].base_url, ids, int(r["output_length"]))
            d = meta.get("cached_tokens_details") or {}
            results[i] = {"ttft_s": ttft, "e2e_s": e2e, "input": len(ids), "cached": int(meta.get("cached_tokens", 0)),
                          "l1": int(d.get("device", 0)), "l2": int(d.get("host", 0)),
                          "l3": int(d.get("storage", 0) or 0), "server": sidx}

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(len(servers)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for x in results if x is not None]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(res: list[dict[str, Any]], makespan: float, args: argparse.Namespace) -> dict[str, Any]:
    total_in = sum(r["input"] for r in res)
    ttfts = [r["ttft_s"] for r in res]
    hit = {k: sum(r[k] for r in res) / total_in for k in ("l1", "l2", "l3")}
    hit["total"] = sum(r["cached"] for r in res) / total_in
    return {"hit_rate": hit,
            "ttft_s": {"mean": statistics.fmean(ttfts), "p50": pct(ttfts, 0.5), "p90": pct(ttfts, args.slo_pct),
                       "p99": pct(ttfts, 0.99)},
            "throughput_req_s": len(res) / makespan, "requests": len(res)}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": values}


def summarize(name: str, tname: str, cells: dict[tuple[int, int], dict[str, Any]], args: argparse.Namespace,
              stats: list[dict[str, Any]]) -> dict[str, Any]:
    """cells[(concurrency, repeat)] -> measure(); the issue's fields plus per-repeat detail."""
    ladder = args.ladder
    reps = sorted({r for _, r in cells})
    base = [cells[(ladder[0], r)] for r in reps]
    at_slo = []
    for r in reps:
        ok = [cells[(c, r)]["throughput_req_s"] for c in ladder if cells[(c, r)]["ttft_s"]["p90"] <= args.slo_s]
        at_slo.append(max(ok) if ok else 0.0)
    hit = {k: statistics.median(m["hit_rate"][k] for m in base) for k in ("l1", "l2", "l3", "total")}
    ttft = {k: statistics.median(m["ttft_s"][k] for m in base) for k in ("mean", "p50", "p99")}
    return {
        "setup": name,
        "trace": tname,
        "hit_rate": hit,
        "ttft_s": ttft,
        "throughput_at_slo_req_s": statistics.median(at_slo),
        "servers": 2,
        "requests": base[0]["requests"],
        "slo": {"ttft_s": args.slo_s, "percentile": args.slo_pct},
        "sizes_tokens_per_server": {"l1": args.l1_tokens, "l2": 2 * args.l1_tokens if name != "l1_only" else 0,
                                    "l3": "shared folder" if name != "l1_only" else 0},
        "spread": {"ttft_mean_s": spread([m["ttft_s"]["mean"] for m in base]),
                   "ttft_p99_s": spread([m["ttft_s"]["p99"] for m in base]),
                   "throughput_at_slo_req_s": spread(at_slo),
                   "hit_total": spread([m["hit_rate"]["total"] for m in base])},
        "ladder": [{"concurrency_per_server": c, "repeat": r, "throughput_req_s": cells[(c, r)]["throughput_req_s"],
                    "ttft_p90_s": cells[(c, r)]["ttft_s"]["p90"], "ttft_mean_s": cells[(c, r)]["ttft_s"]["mean"],
                    "hit_total": cells[(c, r)]["hit_rate"]["total"]} for c in ladder for r in reps],
        "kv_tiers_stats": stats,
    }


def build_traces(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for t in args.traces.split(","):
        if t == "synthetic":
            out[f"synthetic sessions={args.sessions} turns={args.turns}"] = list(generate(args.sessions, args.turns))
        elif t == "sharegpt":
            from sharegpt_trace import build

            out[f"sharegpt conversations={args.conversations} turns<=3"] = build(args.conversations)
        elif t == "unique":
            out[f"synthetic sessions={args.sessions} turns={args.turns} unique"] = list(
                generate(args.sessions, args.turns, unique=True))
        else:
            raise SystemExit(f"unknown trace {t!r}")
    return out


def ideal_hit_rate(trace: list[dict[str, Any]], block: int = 16) -> float:
    """Hit rate of an unbounded shared cache: each request's longest block prefix seen before."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in trace:
        h = r["hash_ids"]
        best = next((k for k in range(len(h), 0, -1) if tuple(h[:k]) in seen), 0)
        hit += best * block
        total += len(h) * block
        seen.update(tuple(h[:k]) for k in range(1, len(h) + 1))
    return hit / total


def kept_stats(servers: list[SGLangServer]) -> list[dict[str, Any]]:
    keep = ("pages_admitted", "pages_skipped", "prefetch_admitted", "prefetch_refused", "l2_loaded_tokens")
    out = []
    for s in servers:
        st = kv_tiers_stats(s)
        out.append({k: v for k, v in st.items() if k in keep} | {"store_hits": st.get("store", {}).get("hits")})
    return out


def lifetimes(setups: list[str], repeats: int) -> list[tuple[str, list[int]]]:
    """Setups in the order A B C, C B A, A B C ... (one entry per repeat), with consecutive runs of
    one setup merged into one server lifetime: [(setup, [repeats])]."""
    seq = [(n, rep) for rep in range(repeats) for n in (setups if rep % 2 == 0 else setups[::-1])]
    out: list[tuple[str, list[int]]] = []
    for n, rep in seq:
        if out and out[-1][0] == n:
            out[-1][1].append(rep)
        else:
            out.append((n, [rep]))
    return out


def run(args: argparse.Namespace, traces: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    setups = args.setups.split(",")
    common = ["--page-size", "16", "--chunked-prefill-size", "512"]
    cells: dict[tuple[str, str], dict[tuple[int, int], dict[str, Any]]] = {}
    stats: dict[str, list[dict[str, Any]]] = {}
    tnames = list(traces)
    plan = lifetimes(setups, args.repeats)
    total = sum(len(reps) for _, reps in plan)
    done = 0
    for name, reps in plan:
        store = tempfile.mkdtemp(prefix=f"kvt-bench-{name}-")
        extra, plugins, env = setup_args(name, store)
        servers = [SGLangServer(tiny_llama_path(), plugins=plugins, extra_args=common + extra,
                                env={**env, "KLLM_KV_TIERS_INSTANCE_ID": f"{name}-{i}"},
                                max_total_tokens=args.l1_tokens, startup_timeout_s=400) for i in range(2)]
        try:
            t0 = time.perf_counter()
            start_all(servers)
            # warm-up in token space 0 (no cell uses it): the first replay after a start is slower
            # (allocations, first batches), and every turn of every setup starts with it
            warm = traces[tnames[0]][: args.warmup]
            replay(servers, warm, assign(len(warm), len(servers), args.seed), 1, 0)
            print(f"== {name}: servers up in {time.perf_counter() - t0:.0f} s, repeats {reps}", file=sys.stderr)
            for rep in reps:
                for k, tname in enumerate(tnames):
                    if tname.endswith(" unique") and name not in args.unique_setups.split(","):
                        continue
                    trace = traces[tname]
                    picks = assign(len(trace), len(servers), args.seed)
                    for j, c in enumerate(args.ladder):
                        for s in servers:
                            flush(s.base_url)
                        time.sleep(args.settle_s)
                        space = 1 + (rep * len(tnames) + k) * len(args.ladder) + j  # same cell, same tokens
                        t1 = time.perf_counter()
                        res = replay(servers, trace, picks, c, space * SPACE)
                        makespan = time.perf_counter() - t1
                        m = measure(res, makespan, args)
                        cells.setdefault((name, tname), {})[(c, rep)] = m
                        print(f"  rep {rep} {tname} c={c}: {makespan:.1f} s, hit {m['hit_rate']['total']:.3f} "
                              f"(l1 {m['hit_rate']['l1']:.3f} l2 {m['hit_rate']['l2']:.3f} l3 {m['hit_rate']['l3']:.3f}), "
                              f"TTFT mean {m['ttft_s']['mean']:.3f} p90 {m['ttft_s']['p90']:.3f}, "
                              f"{m['throughput_req_s']:.2f} req/s", file=sys.stderr, flush=True)
                done += 1
                print(f"  [{done}/{total}] setup-repeats done", file=sys.stderr, flush=True)
            if plugins:
                time.sleep(1.0)  # stats snapshots are written every 0.5 s
                stats.setdefault(name, []).extend(kept_stats(servers))
        finally:
            for s in servers:
                s.stop()
            shutil.rmtree(store, ignore_errors=True)
    return [summarize(n, t, cl, args, stats.get(n, [])) for (n, t), cl in cells.items()]


def report(runs: list[dict[str, Any]], traces: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"two servers per setup, L1 {args.l1_tokens} tokens per server, L2 2x L1, shared L3 folder; "
          f"{args.repeats} repeats interleaved; TTFT at 1 request in flight per server (median of repeats); "
          f"throughput at SLO: TTFT P{int(args.slo_pct * 100)} <= {args.slo_s} s over the closed-loop ladder "
          f"{args.ladder} per server (median of repeats, [min, max])")
    for tname, trace in traces.items():
        rows = [r for r in runs if r["trace"] == tname]
        if not rows:
            continue
        base = next((r for r in rows if r["setup"] == "l1_only"), rows[0])
        stock = next((r for r in rows if r["setup"] == "hicache"), None)
        print(f"\ntrace: {tname}, {len(trace)} requests, ideal hit rate {ideal_hit_rate(trace):.3f}")
        print(f"{'setup':9} {'hit l1':>6} {'l2':>6} {'l3':>6} {'total':>6} {'ttft mean [min,max]':>22} {'p50':>6} "
              f"{'p99':>6} {'@slo [min,max]':>20} {'@slo/l1':>7} {'mean/stock':>10}")
        for r in rows:
            h, t, sp = r["hit_rate"], r["ttft_s"], r["spread"]
            b = base["throughput_at_slo_req_s"]
            ratio = r["throughput_at_slo_req_s"] / b if b else float("nan")
            vs = t["mean"] / stock["ttft_s"]["mean"] if stock else float("nan")
            tm, ts = sp["ttft_mean_s"], sp["throughput_at_slo_req_s"]
            print(f"{r['setup']:9} {h['l1']:6.3f} {h['l2']:6.3f} {h['l3']:6.3f} {h['total']:6.3f} "
                  f"{t['mean']:6.3f} [{tm['min']:.3f},{tm['max']:.3f}] {t['p50']:6.3f} {t['p99']:6.3f} "
                  f"{r['throughput_at_slo_req_s']:6.2f} [{ts['min']:.2f},{ts['max']:.2f}] {ratio:7.3f} {vs:10.3f}")


def record(runs: list[dict[str, Any]], traces: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
           command: str) -> None:
    out = ROOT / "benchmarks" / "results" / "kv_tiers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r["command"] = command
    old = json.loads(out.read_text()) if out.exists() else {}
    kept = [r for r in old.get("runs", []) if r.get("trace") not in traces and "command" in r]
    if kept:  # a partial run (other traces): add its rows, keep the main run's
        old["runs"] = kept + runs
        old.setdefault("more_commands", []).append(command)
        out.write_text(json.dumps(old, indent=1) + "\n")
    doc = {"command": command,
           "method": {"servers_per_setup": 2, "l1_tokens_per_server": args.l1_tokens, "l2": "2x L1 per server",
                      "l3": "folder shared by the setup's two servers", "repeats": args.repeats,
                      "order": "repeat 1: A B C, repeat 2: C B A (servers restarted per turn)", "ladder_concurrency_per_server": args.ladder,
                      "slo": f"TTFT P{int(args.slo_pct * 100)} <= {args.slo_s} s",
                      "throughput_at_slo": "highest closed-loop step throughput whose TTFT percentile meets the SLO",
                      "ttft_and_hit_rate": "at 1 request in flight per server, median over repeats",
                      "ideal_hit_rate": {t: ideal_hit_rate(tr) for t, tr in traces.items()}},
           "runs": runs}
    if not kept:
        out.write_text(json.dumps(doc, indent=1) + "\n")
    cells = []
    for tname in traces:
        cells.append(f"[{tname}] " + "; ".join(
            f"{r['setup']}: hit {r['hit_rate']['total']:.3f} (l1 {r['hit_rate']['l1']:.3f}/l2 {r['hit_rate']['l2']:.3f}"
            f"/l3 {r['hit_rate']['l3']:.3f}), TTFT mean {r['ttft_s']['mean']:.3f} "
            f"[{r['spread']['ttft_mean_s']['min']:.3f}-{r['spread']['ttft_mean_s']['max']:.3f}] "
            f"p50 {r['ttft_s']['p50']:.3f} p99 {r['ttft_s']['p99']:.3f} s, {r['throughput_at_slo_req_s']:.2f} "
            f"[{r['spread']['throughput_at_slo_req_s']['min']:.2f}-{r['spread']['throughput_at_slo_req_s']['max']:.2f}]"
            f" req/s at SLO" for r in runs if r["trace"] == tname))
    with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
        f.write(f"\n## kv_tiers (issue 7), CPU (2 cores, shared), tiny Llama, two servers per setup, interleaved "
                f"repeats, {time.strftime('%Y-%m-%d %H:%M')}\n"
                f"`{command}` — L1 {args.l1_tokens} tokens per server, L2 2x L1, shared L3 folder; {args.repeats} "
                f"repeats (A B C / C B A), medians [min-max]; TTFT and hit rate at 1 request in flight per server; "
                f"throughput at SLO = highest step of the closed-loop ladder {args.ladder} per server with TTFT "
                f"P{int(args.slo_pct * 100)} <= {args.slo_s} s: " + " ".join(cells) + "\n")


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in runs))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 3.5), squeeze=False)
    for ax, tname in zip(axes[0], traces):
        rows = [r for r in runs if r["trace"] == tname]
        for r in rows:
            pts = sorted((x["throughput_req_s"], x["ttft_p90_s"]) for x in r["ladder"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=r["setup"])
        ax.axhline(rows[0]["slo"]["ttft_s"], color="grey", ls="--")
        ax.set_title(tname, fontsize=8)
        ax.set_xlabel("req/s")
        ax.set_ylabel("TTFT P90 (s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description="kv_tiers: L1 only vs stock HiCache vs kv_tiers, two servers each, "
                                             "interleaved repeats")
    ap.add_argument("--setups", default="l1_only,hicache,kv_tiers")
    ap.add_argument("--traces", default="synthetic,sharegpt,unique")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--unique-setups", default="l1_only,kv_tiers", help="setups that also run the no-reuse trace")
    ap.add_argument("--concurrency", default="1,2,4", help="closed-loop ladder: requests in flight per server")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--l1-tokens", type=int, default=1024, help="--max-total-tokens (device KV) per server")
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO")
    ap.add_argument("--slo-pct", type=float, default=0.9, help="TTFT percentile held to the SLO")
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause after each flush")
    ap.add_argument("--warmup", type=int, default=8, help="requests replayed after each start, not measured")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request-to-server coin")
    ap.add_argument("--plot", default="", help="draw TTFT P90 against throughput per setup to this file")
    ap.add_argument("--no-record", action="store_true", help="do not write results files")
    args = ap.parse_args()
    args.ladder = [int(x) for x in args.concurrency.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    traces = build_traces(args)
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    runs = run(args, traces)
    report(runs, traces, args)
    if args.plot:
        plot(runs, args.plot)
    if not args.no_record:
        record(runs, traces, args, command)


if __name__ == "__main__":
    main()
