"""Report and record for bench_tiers.py (not collected by pytest): the side-by-side table, the
summary line, the result summary (through the harness's recorder) and the TTFT-vs-throughput plot."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kllm_plugins.bench.plot import figure
from kllm_plugins.bench.record import record as write_record

# Where the servers ran: benchmarks/gpu/kv_tiers_gpu.py replaces these three for its GPU run
MACHINE: str | None = None
"""None: this machine, as the recorder describes it"""
SHARED = "shared 2-core, several helpers; benchmarks under flock"
LABEL = "CPU (2 cores, quiet), tiny Llama"


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


def slo_crossing(points: list[tuple[float, float]], slo: float) -> float:
    """Throughput at which the TTFT percentile first crosses the SLO.

    `points` are (completed req/s, TTFT percentile) per open-loop rate step, in rising rate. Linear between
    the last step that meets the SLO and the first that misses it, so the figure is not quantized to the
    rate grid; 0.0 when the lowest step misses, the last step's throughput when none misses. Later steps
    that meet the SLO again after a miss do not count (the step figure, `throughput_at_slo_req_s`, takes
    the best step that meets it anywhere)."""
    best = 0.0
    for i, (thr, pct) in enumerate(points):
        if pct > slo:
            if i:
                (t0, p0) = points[i - 1]
                best = t0 + (thr - t0) * (slo - p0) / (pct - p0)
            return max(best, 0.0)
        best = thr
    return best


def report(runs: list[dict[str, Any]], traces: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"{getattr(args, 'servers', 2)} server(s) per setup, L1 {args.l1_tokens} tokens per server, L2 2x L1, shared L3 folder; "
          f"{args.repeats} repeats interleaved; hit rate and TTFT at 1 request in flight per server; open-loop "
          f"rates {args.rate_list} req/s; throughput at SLO: TTFT P{int(args.slo_pct * 100)} <= {args.slo_s} s "
          f"(medians of repeats, [min, max])")
    for tname, trace in traces.items():
        rows = [r for r in runs if r["trace"] == tname]
        if not rows:
            continue
        base = next((r for r in rows if r["setup"] == "l1_only"), rows[0])
        stock = next((r for r in rows if r["setup"] == "hicache"), None)
        print(f"\ntrace: {tname}, {len(trace)} requests, ideal hit rate {ideal_hit_rate(trace):.3f}")
        print(f"{'setup':9} {'hit l1':>6} {'l2':>6} {'l3':>6} {'total':>6} {'ttft mean [min,max]':>22} {'p50':>6} "
              f"{'p99':>6} {'@slo [min,max]':>20} {'@slo/l1':>7} {'x-ing [min,max]':>20} {'x/l1':>6} "
              f"{'mean/stock':>10}")
        for r in rows:
            h, t, sp = r["hit_rate"], r["ttft_s"], r["spread"]
            b = base["throughput_at_slo_req_s"]
            ratio = r["throughput_at_slo_req_s"] / b if b else float("nan")
            bx, x = base.get("throughput_at_slo_interp_req_s", 0.0), r.get("throughput_at_slo_interp_req_s", 0.0)
            xs = sp.get("throughput_at_slo_interp_req_s", {"min": 0.0, "max": 0.0})
            vs = t["mean"] / stock["ttft_s"]["mean"] if stock else float("nan")
            tm, ts = sp["ttft_mean_s"], sp["throughput_at_slo_req_s"]
            print(f"{r['setup']:9} {h['l1']:6.3f} {h['l2']:6.3f} {h['l3']:6.3f} {h['total']:6.3f} "
                  f"{t['mean']:6.3f} [{tm['min']:.3f},{tm['max']:.3f}] {t['p50']:6.3f} {t['p99']:6.3f} "
                  f"{r['throughput_at_slo_req_s']:6.2f} [{ts['min']:.2f},{ts['max']:.2f}] {ratio:7.3f} "
                  f"{x:6.2f} [{xs['min']:.2f},{xs['max']:.2f}] {x / bx if bx else float('nan'):6.3f} {vs:10.3f}")
        paired(rows)
        for r in rows:
            for o in r["open_loop"]:
                bo = next((x for x in base["open_loop"] if x["rate_req_s"] == o["rate_req_s"]), None)
                rel = (f" (x{o['ttft_p50_s']['median'] / bo['ttft_p50_s']['median']:.2f} p50, "
                       f"x{o['throughput_req_s']['median'] / bo['throughput_req_s']['median']:.3f} req/s vs l1_only)"
                       if bo and r is not base else "")
                print(f"  {r['setup']:9} rate {o['rate_req_s']}: {o['throughput_req_s']['median']:.2f} "
                      f"[{o['throughput_req_s']['min']:.2f},{o['throughput_req_s']['max']:.2f}] req/s, TTFT p50 "
                      f"{o['ttft_p50_s']['median']:.3f} [{o['ttft_p50_s']['min']:.3f},{o['ttft_p50_s']['max']:.3f}] "
                      f"p90 {o['ttft_p90_s']['median']:.3f} [{o['ttft_p90_s']['min']:.3f},{o['ttft_p90_s']['max']:.3f}]"
                      + rel)


def paired(rows: list[dict[str, Any]]) -> None:
    """Per repeat (the same lifetime index of each setup): kv_tiers' SLO crossing over L1 only's and its
    serial TTFT mean over stock HiCache's, the ratios the issue's targets are about."""
    by = {r["setup"]: r["spread"] for r in rows}
    if "kv_tiers" not in by:
        return
    k = by["kv_tiers"]
    for other, key, what in (("l1_only", "throughput_at_slo_interp_req_s", "SLO crossing kv_tiers / l1_only"),
                             ("hicache", "ttft_mean_s", "serial TTFT mean kv_tiers / stock")):
        if other not in by or key not in k or key not in by[other]:
            continue
        ratios = [a / b if b else float("nan") for a, b in zip(k[key]["repeats"], by[other][key]["repeats"])]
        print(f"  paired {what}: " + ", ".join(f"{x:.2f}" for x in ratios))


def _row(r: dict[str, Any]) -> str:
    sp = r["spread"]
    ol = "; ".join(f"@{o['rate_req_s']}/s {o['throughput_req_s']['median']:.2f} req/s TTFT p50 "
                   f"{o['ttft_p50_s']['median']:.3f} [{o['ttft_p50_s']['min']:.3f}-{o['ttft_p50_s']['max']:.3f}] p90 "
                   f"{o['ttft_p90_s']['median']:.3f} [{o['ttft_p90_s']['min']:.3f}-{o['ttft_p90_s']['max']:.3f}]"
                   for o in r["open_loop"])
    return (f"{r['setup']}: hit {r['hit_rate']['total']:.3f} (l1 {r['hit_rate']['l1']:.3f}/l2 {r['hit_rate']['l2']:.3f}"
            f"/l3 {r['hit_rate']['l3']:.3f}), TTFT mean {r['ttft_s']['mean']:.3f} "
            f"[{sp['ttft_mean_s']['min']:.3f}-{sp['ttft_mean_s']['max']:.3f}] p50 {r['ttft_s']['p50']:.3f} "
            f"[{sp['ttft_p50_s']['min']:.3f}-{sp['ttft_p50_s']['max']:.3f}] p99 {r['ttft_s']['p99']:.3f} s, "
            f"{r['throughput_at_slo_req_s']:.2f} [{sp['throughput_at_slo_req_s']['min']:.2f}-"
            f"{sp['throughput_at_slo_req_s']['max']:.2f}] req/s at SLO{_crossing(r)} ({ol})")


def _crossing(r: dict[str, Any]) -> str:
    x = r["spread"].get("throughput_at_slo_interp_req_s")
    return "" if x is None else (f", SLO crossing {x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}] req/s "
                                 f"(per repeat {', '.join(f'{v:.2f}' for v in x['repeats'])})")


def headline_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per trace and setup: total hit rate, and the median [min-max] over repeats of TTFT mean and of
    throughput at the SLO (the full spreads, repeats included, are in `runs`)."""
    out: dict[str, Any] = {}
    for r in runs:
        sp = r.get("spread", {})
        row: dict[str, Any] = {"hit_rate": r["hit_rate"]["total"]}
        for k in ("ttft_mean_s", "throughput_at_slo_req_s"):
            if isinstance(sp.get(k), dict):
                row[k] = {q: sp[k][q] for q in ("median", "min", "max") if q in sp[k]}
        out.setdefault(r["trace"].split()[0], {})[r["setup"]] = row
    return out


def record(runs: list[dict[str, Any]], traces: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
           command: str, pressure: dict[str, Any] | None) -> None:
    root = Path(args.results_root)
    for r in runs:
        r["command"] = command
    doc = {"method": {"servers_per_setup": getattr(args, "servers", 2), "l1_tokens_per_server": args.l1_tokens, "l2": "2x L1 per server",
                      "l3": "folder shared by the setup's two servers", "repeats": args.repeats,
                      "order": "repeat 1: A B C, repeat 2: C B A, ... (consecutive turns of a setup share a start)",
                      "server_threads": args.server_threads or "inherited (torch default: one per core)",
                      "open_loop_rates_req_s": args.rate_list, "slo": f"TTFT P{int(args.slo_pct * 100)} <= {args.slo_s} s",
                      "throughput_at_slo": "highest open-loop rate step's completed/makespan whose TTFT percentile "
                                           "meets the SLO; same seeded Poisson schedule for every setup",
                      "throughput_at_slo_interp": "completed req/s where the TTFT percentile first crosses the SLO, "
                                                  "linear between the two rate steps around the crossing",
                      "stop_after_misses": args.stop_after_misses,
                      "schedule": ("one unit-rate Poisson schedule per repeat, divided by each step's rate"
                                   if args.scaled_schedule else "an independent Poisson draw per rate step"),
                      "ttft_and_hit_rate": "one request in flight per server, median over repeats",
                      "ideal_hit_rate": {t: ideal_hit_rate(tr) for t, tr in traces.items()}},
           "runs": runs}
    if pressure:
        doc["pressure"] = pressure
    if args.medium is not None:
        doc["medium"] = args.medium
    try:
        out = write_record("kv_tiers", args.results_name, command, headline_metrics(runs), root=root,
                           machine=MACHINE, shared=SHARED, **doc)
        print(f"recorded {out}")
    except ValueError as exc:  # over the recorder's size limit: keep the run, outside the results folder
        spill = Path(tempfile.gettempdir()) / f"kv_tiers_{args.results_name}.json"
        spill.write_text(json.dumps({"command": command, "metrics": headline_metrics(runs), **doc}, indent=1))
        print(f"not recorded: {exc}; the whole summary is in {spill}")
    cells = [f"[{t}] " + "; ".join(_row(r) for r in runs if r["trace"] == t) for t in traces]
    if pressure:
        cells.append("[pressure] " + pressure["summary"])
    # the summary line (benchmarks/RESULTS.md is generated from the result files)
    print(f"\n## kv_tiers (issue 7), {LABEL}, {getattr(args, 'servers', 2)} server(s) per setup, interleaved "
          f"repeats, open-loop load{medium_note(args)}, {time.strftime('%Y-%m-%d %H:%M')}\n"
          f"`{command}` — L1 {args.l1_tokens} tokens per server, L2 2x L1, shared L3 folder; "
          f"{threads_note(args)}; {args.repeats} "
          f"repeats (A B C / C B A ...), medians [min-max]; hit rate and TTFT at 1 request in flight per "
          f"server; open-loop Poisson rates {args.rate_list} req/s (same schedule for every setup), "
          f"throughput at SLO = highest rate step's completed/makespan with TTFT P{int(args.slo_pct * 100)} "
          f"<= {args.slo_s} s (SLO crossing: linear between the steps around the first miss"
          f"{stop_note(args)}): " + " ".join(cells) + "\n")


def stop_note(args: argparse.Namespace) -> str:
    n = args.stop_after_misses
    return ((f"; a repeat's rate ladder stops after {n} consecutive misses" if n else "")
            + ("; every step replays one schedule scaled by its rate" if args.scaled_schedule else ""))


def threads_note(args: argparse.Namespace) -> str:
    n = args.server_threads
    return f"{n} OpenMP thread(s) per server" if n > 0 else "OpenMP threads per server: torch's default"


def medium_note(args: argparse.Namespace) -> str:
    m = args.medium
    return "" if m is None else (f", L3 (both setups) on an emulated slow medium: {m['latency_ms']:g} ms + "
                                 f"{m['mb_s']:g} MB/s per page read / existence check")


def plot(runs: list[dict[str, Any]], path: str) -> None:
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    with figure(path, cols=len(traces), size=(5 * len(traces), 3.5), dpi=100) as axes:
        if axes is not None:
            _draw(axes, runs, traces)


def _draw(axes: Any, runs: list[dict[str, Any]], traces: list[str]) -> None:
    for ax, tname in zip(axes[0], traces):
        rows = [r for r in runs if r["trace"] == tname]
        for r in rows:
            pts = [(o["throughput_req_s"]["median"], o["ttft_p90_s"]["median"]) for o in r["open_loop"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=r["setup"])
        ax.axhline(rows[0]["slo"]["ttft_s"], color="grey", ls="--")
        ax.set_title(tname, fontsize=8)
        ax.set_xlabel("req/s")
        ax.set_ylabel("TTFT P90 (s)")
        ax.legend(fontsize=7)
