"""Benchmark helper (not library code): the simulated-clock grid of the fair_sched benchmark
(traces x loads x seeds x policies, `sim_engine.py`), the issue's targets checked on seed means,
ratios printed side by side with their per-seed spread, and a small JSON summary."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import sim_engine as se
import targets
import traces as tr
from kllm_plugins.plugins.fair_sched.config import FairSchedConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
METRICS = ("mean", "p90", "p99", "short_p90", "long_mean", "tpot", "throughput")
LOADS = (0.6, 0.85)
SIM_SHARED = "shared 2-core; the simulation is deterministic"


def config_from(pairs: list[str]) -> FairSchedConfig:
    from kllm_plugins.spec import parse_bool

    kw: dict[str, Any] = {}
    for kv in pairs:
        k, v = kv.split("=", 1)
        k = k.removeprefix("KLLM_FAIR_SCHED_").lower()
        d = getattr(FairSchedConfig(), k)
        kw[k] = parse_bool(v) if isinstance(d, bool) else type(d)(v)
    return FairSchedConfig(**kw)


def overtake_ratio(reqs: list[se.Req], age_weight: float) -> float:
    """The bound's quantity: max over requests r of (clock at the arrival of a request that
    arrived after r and started its prefill before r, minus r's arrival clock) / (age_weight x r's
    work). FairPolicy guarantees <= 1 (no request that arrives after the engine processed
    age_weight x work(r) more tokens starts before r); 0 when nobody overtook."""
    worst = 0.0
    by_start = sorted(reqs, key=lambda r: r.start_pass)
    for r in reqs:
        for s in by_start:
            if s.start_pass >= r.start_pass:
                break
            if s.arrival > r.arrival and s.clock > r.clock:
                worst = max(worst, (s.clock - r.clock) / max(age_weight * r.work, 1e-9))
    return worst


def checks(at: dict[str, list[dict[str, float]]], ours: str) -> dict[str, dict[str, Any]]:
    """The issue's targets on the seed means of `at[policy]` (one summary per seed)."""
    return targets.check({p: {k: statistics.fmean(x[k] for x in runs) for k in METRICS} for p, runs in at.items()}, ours)

def run_sim_grid(args: Any) -> dict[str, Any]:
    scale = tr.SCALES[args.scale]
    chunk = args.chunk or scale.chunk
    costs = args.costs or args.scale
    cm = se.COSTS[costs]
    cfg = config_from(args.fair_env)
    long_tokens = 8 * scale.chunk  # reporting only: "long" = a prompt over 8 chunks of the trace's scale
    policies = list(se.STOCK) + list(se.OURS)
    t0 = time.time()
    cells: list[dict[str, Any]] = []
    lines: list[str] = []
    for trace in tr.TRACES:
        cal = tr.make(trace, scale, 60, 999)
        cap = se.capacity(cal, chunk, cm)
        for load in LOADS:
            at: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
            bound: dict[str, float] = {}
            for seed in range(args.seeds):
                jobs = tr.make(trace, scale, args.requests, seed)
                for p in policies:
                    pol = se.make_policy(p, chunk, cfg)
                    reqs = se.simulate(jobs, load * cap, pol, chunk, cm, seed)
                    at[p].append(se.summary(reqs, long_tokens))
                    if p in se.OURS:
                        bound[p] = max(bound.get(p, 0.0), overtake_ratio(reqs, cfg.age_weight))
            cell = {"trace": trace, "load": load, "capacity_req_s": round(cap, 4), "seeds": args.seeds,
                    "mean": {p: {k: round(statistics.fmean(x[k] for x in at[p]), 5) for k in METRICS} for p in policies},
                    "ratio_to_fcfs_per_seed": {p: {k: [round(x[k] / b[k], 3) for x, b in zip(at[p], at["fcfs"])]
                                                   for k in METRICS} for p in policies if p != "fcfs"},
                    "targets": {p: checks(at, p) for p in se.OURS},
                    "overtake_ratio_max": {p: round(v, 3) for p, v in bound.items()}}
            cells.append(cell)
            lines += format_cell(cell, policies)
    met = {p: sum(all(c["targets"][p][k]["met"] for k in c["targets"][p]) for c in cells) for p in se.OURS}
    lines.append(f"cells meeting every target: " + ", ".join(f"{p} {n}/{len(cells)}" for p, n in met.items()))
    print("\n".join(lines), flush=True)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"fair_sched_sim_{args.scale}_{chunk}.json")
    cost_note = {"production": "; production costs assumed, not measured",
                 "h200": "; costs fitted to SGLang's measured prefill and decode on the H200 (see sim_engine.py)"}
    doc = {"kind": f"simulation ({args.scale} scale{cost_note.get(costs, '')})", "costs": costs,
           "command": "python benchmarks/fair_sched/sim_engine.py " + " ".join(
               f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(v)}" for k, v in vars(args).items() if v not in ("", [], 0)),
           "commit": _commit(), "machine": platform.node() + " (shared, 2 cores; the simulation is deterministic)",
           "chunk": chunk, "requests_per_run": args.requests, "long_prompt_over_tokens": long_tokens,
           "fair_config": {k: v for k, v in vars(cfg).items()}, "wall_s": round(time.time() - t0, 1),
           "cells_meeting_every_target": met, "cells": cells,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "metrics": headline(cells)}
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return doc


def headline(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cell and policy of ours: the target ratios (seed means) and whether all held."""
    return {f"{c['trace']}@{c['load']}": {p: {**{k: v["value"] for k, v in t.items()}, "all_met": all(v["met"] for v in t.values())}
                                          for p, t in c["targets"].items()} for c in cells}


def format_cell(cell: dict[str, Any], policies: list[str]) -> list[str]:
    lines = [f"{cell['trace']} @ {cell['load']} (capacity {cell['capacity_req_s']:.3f} req/s): seed mean [ratio to fcfs, per-seed min-max]"]
    lines.append(f"  {'metric':11s}" + "".join(f"{p:>32s}" for p in policies))
    for k in METRICS:
        row = f"  {k:11s}"
        base = cell["mean"]["fcfs"][k]
        for p in policies:
            v = cell["mean"][p][k]
            if p == "fcfs":
                row += f"{v:>32.4g}"
            else:
                s = cell["ratio_to_fcfs_per_seed"][p][k]
                row += f"{f'{v:.4g} [{v / base:.2f}x {min(s):.2f}-{max(s):.2f}]':>32s}"
        lines.append(row)
    for p, ch in cell["targets"].items():
        lines.append(f"  {p}: " + "; ".join(f"{k} {c['value']:.2f} {'ok' if c['met'] else 'MISS'}" for k, c in ch.items())
                     + f"; overtake ratio {cell['overtake_ratio_max'].get(p, 0):.2f}")
    return lines


def studies_renderer(marker: str, table: Any, script: str) -> Any:
    """`render(text, summary)`: `text` with its `marker` table in docs/fair_sched_studies.md replaced
    by `table(summary)` (the table `script --write-doc` writes)."""
    def render(text: str, summary: dict[str, Any]) -> str:
        from kllm_plugins.plugin_docs import replace_generated

        return replace_generated(text, marker, table(summary), f"python {script} --write-doc",
                                 "docs/fair_sched_studies.md")
    return render


def cells_search_main(description: str, out: Any, doc: Any, run: Any, show: Any, render: Any) -> int:
    """The main of a what-if search over the H100 cells (`--seeds`, `--chunks`, `--workers`,
    `--write-doc`): `run(seeds, chunks, workers)`, recorded at `out`, or the doc's tables only."""
    import argparse

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write-doc", action="store_true", help="only rewrite the table from the recorded summary")
    a = ap.parse_args()
    return record_or_write_doc(a.write_doc, out, doc, lambda: run(a.seeds, a.chunks, a.workers), show, render)


def record_or_write_doc(write_doc: bool, out: Any, doc: Any, run: Any, show: Any, render: Any) -> int:
    """A what-if script's main: `run()` and record its summary at `out` (printing `show(summary)`), or
    with `write_doc` only rewrite `doc`'s generated tables (`render(text, summary)`) from the recorded one."""
    from kllm_plugins.bench.record import load_summary, write_summary
    from kllm_plugins.plugin_docs import rewrite_doc

    if write_doc:
        summary = load_summary(out)
        rewrite_doc(doc, lambda text: render(text, summary))
        return 0
    summary = run()
    write_summary(out, summary)
    print(show(summary))
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
