"""GPU row of fair_sched: SGLang's stock policies (fcfs, lpm, shortest-prefill-first, hrrn) vs
fair_sched on the fair-scheduling trace family (benchmarks/fair_sched/traces.py), on SGLang
(kllm_cuda, 8B-shaped random bf16 model, CUDA graphs on) at chunk sizes 2048 and 8192.

The trace's lengths are drawn in chunks of 2048 tokens (`--traces bursty lognormal ...`; `bursty`
is issue 27's losing trace: 90% of 0.25-2 chunks, 10% of 12-24 chunks, on/off arrivals), cut at
`--max-prompt` (the random model's KV pool on a GPU shared by five servers), and the same requests
are replayed at both chunk sizes. Per chunk size: one server per policy, all up at once; per
trace, capacity measured on fcfs (a burst of the trace's requests at once), the load a fraction of
it; each seed runs the policies in order,
the next seed in reverse (ABBA); the prefix cache is flushed before every run. Streaming client:
benchmarks/fair_sched/serving.py; summaries: benchmarks/fair_sched/workload.py.

    python benchmarks/gpu/fair_sched_gpu.py --chunks 2048 8192 --traces bursty mooncake --requests 40 --out F.json [--loads 0.6 0.85] [--cpu-dry-run]

`--variant TAG:KEY=V[,KEY=V]` adds a fair_sched server with those options (`fair_sched/TAG`), run and
checked against the same targets beside the defaults. `--mixed-chunk-stock POLICY ...` adds stock
servers with SGLang's `--enable-mixed-chunk` (`POLICY+mixed`), checked as candidates against the
same targets; the baselines stay the stock policies without it, as issue 27 states them.

`--prefill-only` ends every request at its first token (max_new_tokens 1), so no server runs a
decode pass of its own (fair_sched with its defaults: its adapter counts no request whose only
token is its prefill's as decoding; the H200 runs recorded on 2026-12-07 predate that and stepped
aside for a decode 8-27 times a cell): the prefill server of a disaggregated pair (SGLang's `--disaggregation-mode prefill` hands a request off at its first
token), less the KV transfer: SGLang's prefill mode refuses its `fake` transfer backend, and the
GPU pack (scripts/gpu/pack.sh) carries no Mooncake build. TPOT is then the decode server's and
not measured (NaN; nothing to miss); the CPU grid with both servers (`benchmarks/fair_sched/
server_grid.py --pd`) measures it. CUDA graphs (decode only) are off.

Five 8B-shaped servers need an H200 (141 GB); `--layers 16` fits them on an 80 GB H100.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fair_sched"))
from gpu_bench_common import Setup, header, log, write  # noqa: E402
from serving import MIXED, Job, fair_totals, mixed_stock, parse_variant, run_jobs  # noqa: E402
from targets import STOCK, check as check_targets  # noqa: E402
from traces import gpu_scale, make, prompt_ids  # noqa: E402
from workload import summarize  # noqa: E402

POLICIES = ("fcfs", "lpm", "shortest-prefill-first", "hrrn", "fair_sched")
COUNTERS = ("yields_to_short", "yields_to_decode", "limited_passes", "long_started", "long_finished", "long_chunks",
            "chunks_cut_for_kv", "chunks_parked_for_kv", "waiting_prefill_s", "waiting_decode_s")
GAUGES = ("decode_run_max", "timing_lag", "decode_step_ms")
KEYS = ("ttft_s", "ttft_short_s", "ttft_long_s")
def jobs_of(reqs: list[Any], rate: float, salt: str, trace_chunk: int, tag: str, first_only: bool = False) -> list[Job]:
    """The trace's requests as jobs; `first_only`: each ends at its first token (`--prefill-only`)."""
    return [Job(f"{tag}-{i}", r.arrival_s / rate if rate > 0 else 0.0, prompt_ids(r, salt=salt),
                1 if first_only else r.output_len,
                "long" if r.input_len >= 8 * trace_chunk else "short") for i, r in enumerate(reqs)]


def is_fair(policy: str) -> bool:
    """fair_sched itself or one of its variants (`fair_sched/TAG`)."""
    return policy == "fair_sched" or policy.startswith("fair_sched/")


def flush(srv: Any) -> None:
    from kllm_plugins.testing.sglang_server import flush_cache

    flush_cache(srv.base_url)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--traces", nargs="+", default=["bursty"], help="traces of traces.py, run in turn on the same servers")
    ap.add_argument("--trace-chunk", type=int, default=2048, help="the trace's lengths are in chunks of this size")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--loads", type=float, nargs="+", default=None,
                    help="several loads (fractions of the fcfs capacity), each seed run at each; overrides --load")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--cal-requests", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=40960)
    ap.add_argument("--pool-tokens", type=int, default=57344)
    ap.add_argument("--out-tokens", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--variant", action="append", default=[], metavar="TAG:KEY=V[,KEY=V]",
                    help="a fair_sched server with these options beside the others (fair_sched/TAG)")
    ap.add_argument("--mixed-chunk-stock", nargs="+", default=[], choices=STOCK, metavar="POLICY",
                    help="stock policies also run with --enable-mixed-chunk (POLICY+mixed), as candidates")
    ap.add_argument("--layers", type=int, default=0,
                    help="hidden layers of the 8B-width model (0: 32, the 8B shape); fewer fit five servers on an 80 GB card")
    ap.add_argument("--prefill-only", action="store_true",
                    help="every request ends at its first token: the prefill side of a disaggregated pair")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--recompute", nargs="+", default=[], metavar="FILE",
                    help="rewrite these result files' metrics from their runs and errors (after a change to `metrics`), and stop")
    a = ap.parse_args()
    if a.recompute:
        for path in a.recompute:
            recompute(path)
        return 0
    if not a.out:
        ap.error("--out is required")
    try:
        variants = dict(map(parse_variant, a.variant))
    except ValueError as exc:
        ap.error(str(exc))
    a.policies = [*a.policies, *variants, *(p + MIXED for p in a.mixed_chunk_stock)]
    loads = a.loads or [a.load]
    shape = {"num_hidden_layers": a.layers} if a.layers else {}
    setup = Setup(a.cpu_dry_run, max_positions=max(8192, a.max_prompt + 1024), **shape)
    scale = gpu_scale(a.trace_chunk, a.max_prompt, *a.out_tokens)
    res = header("benchmarks/gpu/fair_sched_gpu.py", "python " + " ".join(sys.argv), setup,
                 {"traces": a.traces, "variants": a.variant, "mixed_chunk_stock": a.mixed_chunk_stock, "layers": a.layers or 32, "trace_chunk": a.trace_chunk, "max_prompt": a.max_prompt, "requests": a.requests,
                  "load": loads[0] if len(loads) == 1 else loads, "seeds": a.seeds, "chunks": a.chunks, "policies": a.policies, "cal_requests": a.cal_requests,
                  "pool_tokens": a.pool_tokens, "output_tokens": [1, 1] if a.prefill_only else a.out_tokens,
                  "prefill_only": a.prefill_only,
                  "long": f">= 8 x {a.trace_chunk} prompt tokens"})
    res["runs"], res["calibration"] = [], {}
    from kllm_plugins.testing.sglang_server import start_all

    t_start = time.perf_counter()
    for chunk in a.chunks:
        servers: dict[str, Any] = {}
        for p in a.policies:
            ours = is_fair(p)
            base = mixed_stock(p)
            extra = ["--chunked-prefill-size", str(chunk), "--schedule-policy", "fcfs" if ours else base or p]
            if base is not None:
                extra.append("--enable-mixed-chunk")
            if setup.cpu:
                extra += ["--context-length", str(a.max_prompt + 1024)]
            env = {"KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1", **variants.get(p, {})} if ours else {}
            if setup.cpu:
                env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
            servers[p] = setup.server(["fair_sched"] if ours else [], extra, env, a.pool_tokens,
                                      a.mem_fraction, graphs=not a.prefill_only, name=f"{p.replace('/', '-')}-{chunk}")
        try:
            t0 = time.perf_counter()
            start_all(list(servers.values()))
            log("fair", f"chunk {chunk}: {len(servers)} servers up in {time.perf_counter() - t0:.0f} s")
            warm = make(a.traces[0], scale, 6, 97)

            def warm_up(kv: tuple[str, Any]) -> str | None:
                try:
                    run_jobs(kv[1].base_url, jobs_of(warm, 0.0, "warm", a.trace_chunk, "warm", a.prefill_only))
                    return None
                except Exception as exc:  # noqa: BLE001 - a server that dies here is recorded and left out
                    return repr(exc)[:500]

            with ThreadPoolExecutor(len(servers)) as pool:  # warm-up at once: Triton kernels, graphs
                failed = dict(zip(servers, pool.map(warm_up, servers.items())))
            for p, err in failed.items():
                if err is not None:
                    srv = servers.pop(p)
                    res.setdefault("errors", []).append({"chunk": chunk, "policy": p, "phase": "warm-up", "error": err,
                                                         "log_tail": srv.log_tail(40)[-4000:]})
                    srv.stop()
                    log("fair", f"chunk {chunk} {p}: warm-up FAILED {err} (left out)")
            base = servers.get("fcfs") or next(iter(servers.values()))
            lo, hi = 12 * a.trace_chunk, min(24 * a.trace_chunk, a.max_prompt)
            solo = {}
            for n in (lo, hi):
                flush(base)
                solo[n] = run_jobs(base.base_url, [Job(f"solo-{n}", 0.0, [11 + (i * 7) % 3000 for i in range(n)], 4,
                                                       "long")])[0].ttft_s
            slope = (solo[hi] - solo[lo]) / (hi - lo) if hi > lo else 0.0
            solo_fn = lambda n: max(solo[lo] + slope * (n - lo), 1e-3)  # noqa: E731
            for trace in a.traces:
                cal_reqs = make(trace, scale, a.cal_requests, 99)
                flush(base)
                t0 = time.perf_counter()
                run_jobs(base.base_url, jobs_of(cal_reqs, 0.0, "cal", a.trace_chunk, "cal", a.prefill_only))
                capacity = a.cal_requests / (time.perf_counter() - t0)
                res["calibration"][f"{trace}@{chunk}"] = {"capacity_req_s": capacity,
                                                          "solo_long_ttft_s": {str(k): v for k, v in solo.items()}}
                log("fair", f"{trace} chunk {chunk}: capacity {capacity:.2f} req/s, solo long TTFT {solo}")
                turn = 0
                for seed in range(a.seeds):
                    reqs = make(trace, scale, a.requests, seed)
                    for load in loads:
                        order = list(a.policies) if turn % 2 == 0 else list(a.policies)[::-1]
                        turn += 1
                        for p in [p for p in order if p in servers]:
                            if not run_one(a, res, servers[p], p, trace, chunk, seed, reqs, load * capacity, solo_fn,
                                           t_start, load if len(loads) > 1 else None):
                                servers.pop(p).stop()  # it exited: left out of the later runs, its error recorded
        finally:
            for srv in servers.values():
                srv.stop()
    res["metrics"] = metrics(res["runs"], res.get("errors"))
    write(a.out, res)
    return 0


def run_one(a: Any, res: dict[str, Any], srv: Any, p: str, trace: str, chunk: int, seed: int, reqs: list[Any],
            rate: float, solo_fn: Any, t_start: float, load: float | None = None) -> bool:
    """One policy's run of one seed of one trace (at `load` when the driver runs several, recorded
    in the row); a failure is recorded with the server's state.
    Returns False when the server has exited (stock SGLang's chunk overcommit can end it)."""
    at = {} if load is None else {"load": load}
    try:
        flush(srv)
        before = fair_totals(srv, COUNTERS) if is_fair(p) else {}
        t0 = time.perf_counter()
        outs = run_jobs(srv.base_url, jobs_of(reqs, rate, f"s{seed}", a.trace_chunk, f"{p}-{seed}", a.prefill_only))
    except Exception as exc:  # noqa: BLE001 - recorded with the server's state; the others go on
        alive = (srv.proc is not None and srv.proc.poll() is None
                 and not srv.grep_log(r"Scheduler hit an exception|SIGQUIT received"))
        res.setdefault("errors", []).append({"trace": trace, "chunk": chunk, **at, "policy": p, "seed": seed,
                                             "error": repr(exc)[:500], "server_alive": alive,
                                             "log_tail": srv.log_tail(40)[-4000:]})
        write(a.out, res)
        log("fair", f"{trace} chunk {chunk} {p} s{seed}: FAILED {exc!r} (server alive: {alive})")
        return alive
    wall = time.perf_counter() - t0
    row = {"trace": trace, "chunk": chunk, **at, "policy": p, "seed": seed, "rate_req_s": rate, "requests": len(outs),
           **summarize(outs, wall, solo_fn)}
    if before:
        after = fair_totals(srv, (*COUNTERS, *GAUGES))
        row["fair_sched_counters"] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
        # not counts: a maximum since start, the pass-timing lag in force, the decode step's estimate
        row["fair_sched_counters"].update({k: after.get(k, 0) for k in GAUGES})
    res["runs"].append(row)
    res["metrics"] = metrics(res["runs"], res.get("errors"))
    write(a.out, res)
    log("fair", f"[{time.perf_counter() - t_start:.0f}s] {trace} chunk {chunk}{f' load {load}' if at else ''} {p} "
        f"s{seed}: ttft mean "
        f"{row['ttft_s']['mean']:.2f} p90 {row['ttft_s']['p90']:.2f} p99 {row['ttft_s']['p99']:.2f}; short p90 "
        f"{row['ttft_short_s'].get('p90', float('nan')):.2f}; long mean "
        f"{row['ttft_long_s'].get('mean', float('nan')):.2f}; tpot {1e3 * row['tpot_s']['mean']:.1f} ms; "
        f"thr {row['throughput_req_s']:.2f} req/s {row.get('fair_sched_counters', '')}")
    return True



def recompute(path: str) -> None:
    """A recorded file's `metrics` derived again from its `runs` and `errors`, in place (compact JSON,
    figures to 5 significant digits, as the files under benchmarks/results/fair_sched are kept)."""
    import json

    def rounded(v: Any) -> Any:  # NaN stays NaN: the tables read it as "nothing to compare"
        if isinstance(v, float):
            return float(f"{v:.5g}") if math.isfinite(v) else v
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return [rounded(x) for x in v] if isinstance(v, list) else v

    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    res["metrics"] = metrics(res["runs"], res.get("errors"))
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(rounded(res), separators=(",", ":")) + "\n")


def cell_key(r: dict[str, Any]) -> str:
    """`trace@chunk`, or `trace@chunk@load` for a run of a driver that ran several loads."""
    return f"{r.get('trace', 'bursty')}@{r['chunk']}" + (f"@{r['load']}" if "load" in r else "")


def _figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seed means (min/max beside) of one policy's runs in one cell."""
    import statistics

    fig: dict[str, Any] = {"seeds": len(rs)}
    picks = [(f"{k}_{q}", k, q) for k in KEYS for q in ("mean", "p50", "p90", "p99")]
    picks += [("tpot_s_mean", "tpot_s", "mean"), ("long_ttft_over_solo_max", "long_ttft_over_solo", "max")]
    picks += [("e2e_s_mean", "e2e_s", "mean"), ("decode_s_mean", "decode_s", "mean")]  # runs after 2026-12-07
    picks += [("throughput_req_s", "throughput_req_s", None)]
    for name, key, q in picks:
        vals = [r[key] if q is None else r[key][q] for r in rs if q is None or q in r.get(key, {})]
        if vals:
            fig[name] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
    return fig


def metrics(runs: list[dict[str, Any]], errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per cell (`cell_key`) and policy: the mean over seeds of each figure (min/max beside), its ratio
    to fcfs (below 1 is better for TTFT and TPOT), and fair_sched's targets of issue 27 on seed
    means (mean and short P90 against the best stock policy, the rest against fcfs).

    Every policy is compared on the seeds that all policies whose servers stayed up ran: a seed the
    call's time limit cut short is left out (`seeds_left_out`). A server that exited before the
    cell's last seed (`exited`: SGLang's chunk overcommit ends stock servers) is left out of the
    targets; fair_sched's mean and short P90 against it on the seeds it did run are kept apart
    (`exited_stock`), since leaving the best stock policy out flatters fair_sched."""
    out: dict[str, Any] = {}
    order = list(dict.fromkeys(r.get("trace", "bursty") for r in runs))  # traces in the order they ran
    for ck in sorted({cell_key(r) for r in runs}):
        in_cell = [r for r in runs if cell_key(r) == ck]
        trace, chunk = in_cell[0].get("trace", "bursty"), in_cell[0]["chunk"]
        # a server that exited (an error in this chunk: in its warm-up, on this trace or on one run before
        # it) missed the rest of the file's runs there; loads run within a seed
        failed = {e["policy"] for e in errors or [] if e.get("chunk") == chunk
                  and ("trace" not in e or (e["trace"] in order and order.index(e["trace"]) <= order.index(trace)))}
        seeds = {p: {r["seed"] for r in in_cell if r["policy"] == p} for p in dict.fromkeys(r["policy"] for r in in_cell)}
        alive = [p for p in seeds if p not in failed]
        common = set.intersection(*(seeds[p] for p in alive)) if alive else set()
        alive += [p for p in seeds if p in failed and common and seeds[p] >= common]  # exited after this cell's runs
        exited = sorted(failed - set(alive))
        cell: dict[str, Any] = {p: _figures([r for r in in_cell if r["policy"] == p and r["seed"] in common])
                                for p in alive if common}
        left_out = sorted({r["seed"] for r in in_cell if r["policy"] in alive} - common)
        if left_out and common:
            cell["seeds_left_out"] = left_out
        if exited:
            cell["exited"] = exited
        for p in (q for q in exited if q in seeds):
            cell[p] = _figures([r for r in in_cell if r["policy"] == p])  # its own seeds; named in `exited`
        if common and "fcfs" in alive:
            for p in alive:
                fig = cell[p]
                if p != "fcfs":
                    fig["vs_fcfs"] = {k: fig[k]["mean"] / cell["fcfs"][k]["mean"] for k in fig
                                      if isinstance(fig[k], dict) and k in cell["fcfs"] and cell["fcfs"][k]["mean"] > 0}
            whole = {p: cell[p] for p in alive}
            if "fair_sched" in whole:
                cell["targets"] = targets(whole)
                ex = {}
                for p in (q for q in exited if q in seeds and q in STOCK):
                    both = sorted(seeds[p] & seeds["fair_sched"])
                    if both:
                        mine, theirs = (_figures([r for r in in_cell if r["policy"] == q and r["seed"] in both])
                                        for q in ("fair_sched", p))
                        ex[p] = {"seeds": both, **{k: mine[v]["mean"] / theirs[v]["mean"] for k, v in
                                                   (("mean", "ttft_s_mean"), ("short_p90", "ttft_short_s_p90"))
                                                   if v in mine and v in theirs and theirs[v]["mean"] > 0}}
                if ex:
                    cell["exited_stock"] = ex
            variants = [p for p in whole if p.startswith("fair_sched/") or mixed_stock(p)]
            if variants:
                cell["variant_targets"] = {p: targets(whole, p) for p in variants}
        out[ck] = cell
    return out


def targets(cell: dict[str, Any], ours: str = "fair_sched") -> dict[str, Any]:
    """Issue 27's targets for fair_sched (or a variant, `ours`) in one cell (seed means); stock
    policies whose runs failed are absent."""
    names = {"mean": "ttft_s_mean", "short_p90": "ttft_short_s_p90", "p99": "ttft_s_p99",
             "long_mean": "ttft_long_s_mean", "tpot": "tpot_s_mean", "throughput": "throughput_req_s"}
    means = {p: {k: cell[p][v]["mean"] if v in cell[p] else math.nan for k, v in names.items()}
             for p in (*STOCK, ours) if p in cell}
    return check_targets(means, ours)

if __name__ == "__main__":
    sys.exit(main())
