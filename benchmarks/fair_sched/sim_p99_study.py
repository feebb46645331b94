"""What-if study (not a measurement, not collected by pytest): why fair_sched's TTFT P99 misses
fcfs on the real CPU servers, asked of the simulated clock (`sim_engine.py`, CPU costs, chunk
128, the five traces of `traces.py` at loads 0.6 and 0.85 of the fcfs capacity, as `grid.py`).

1. Noise: every policy on `--seeds` seeds at 120 requests a run (the real-server grid) and at
   400 (the simulated grid). Per cell: each seed's P99 / fcfs P99 (median, P10-P90), the ratio of
   the all-seed means, the ratio on seeds 0-2 (the traces the real servers replayed), and over
   every 3-seed subset the share whose ratio of 3-seed means exceeds 1: the chance that a 3-seed
   grid reports a miss.
2. Trade-off: fair_sched with `age_weight` from 0 (arrival order) to 1e6 (size order), other
   options as configured, and the same without its decode steps (`decode_share` 0, as stock
   SGLang, which decodes only in passes without a prefill): per cell on seed means, mean TTFT /
   best stock mean, P99, TPOT and long-prompt mean / fcfs, and which requests make the P99 (the
   share of prompts over 8 chunks among those at or above it). An analysis: defaults unchanged.

    python benchmarks/fair_sched/sim_p99_study.py --seeds 20          # runs both, records the JSON
    python benchmarks/fair_sched/sim_p99_study.py --write-doc         # docs table from the JSON
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402
import sim_engine as se  # noqa: E402
import traces as tr  # noqa: E402

from kllm_plugins.plugin_docs import generated_block, replace_generated  # noqa: E402
from kllm_plugins.bench.record import load_summary, record, result_path, round_floats  # noqa: E402
from kllm_plugins.bench.stats import quantile  # noqa: E402

STOCK = ("fcfs", "shortest-prefill-first", "hrrn")  # lpm equals fcfs in the model (no prefix cache)
VARIANTS = {"default": [], "decode_share_0": ["decode_share=0"]}
"""fair_sched as configured, and without its decode steps (decode_share 0, what stock SGLang does)."""
FIELDS = ("mean / best stock", "p99 / fcfs", "tpot / fcfs", "long mean / fcfs", "long share at >= p99")
WEIGHTS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0, 4096.0, 1e6)
SIZES = (120, 400)
CHUNK = 128
LONG = 8 * CHUNK  # "long" prompt: over 8 chunks (as grid.py)
DOC = Path(__file__).resolve().parents[2] / "docs" / "fair_sched_studies.md"


def subset_ratios(ours: list[float], base: list[float], k: int = 3) -> list[float]:
    """mean(ours[S]) / mean(base[S]) for every k-subset S of the seeds (paired by index)."""
    if len(ours) != len(base) or len(ours) < k:
        raise ValueError(f"need two paired lists of >= {k} seeds, got {len(ours)} and {len(base)}")
    return [sum(ours[i] for i in s) / sum(base[i] for i in s) for s in itertools.combinations(range(len(ours)), k)]


def noise_stats(ours: list[float], base: list[float]) -> dict[str, float]:
    per_seed = [a / b for a, b in zip(ours, base)]
    sub = subset_ratios(ours, base)
    return {"median": quantile(per_seed, 0.5), "p10": quantile(per_seed, 0.1), "p90": quantile(per_seed, 0.9),
            "ratio_of_means": statistics.fmean(ours) / statistics.fmean(base),
            "seeds_0_2": sum(ours[:3]) / sum(base[:3]),
            "miss_3seed": sum(r > 1.0 for r in sub) / len(sub)}


def run_one(jobs: list[tr.TraceRequest], rate: float, policy: str, aw: float | None, fair_env: list[str],
            seed: int) -> dict[str, float]:
    cfg = grid.config_from(fair_env + ([f"age_weight={aw}"] if aw is not None else []))
    reqs = se.simulate(jobs, rate, se.make_policy(policy, CHUNK, cfg), CHUNK, se.COSTS["cpu"], seed)
    s = se.summary(reqs, LONG)
    tail = [r for r in reqs if r.first_s - r.arrival >= s["p99"]]
    s["tail_long"] = sum(r.work > LONG for r in tail) / len(tail)
    return s


def collect(seeds: int, fair_env: list[str]) -> dict[str, Any]:
    """{n: {cell: {policy, or variant@age_weight: [summary per seed]}}}."""
    out: dict[str, Any] = {}
    for n in SIZES:
        for trace in tr.TRACES:
            cap = se.capacity(tr.make(trace, "cpu", 60, 999), CHUNK, se.COSTS["cpu"])
            for load in grid.LOADS:
                at: dict[str, list[dict[str, float]]] = {}
                for seed in range(seeds):
                    jobs = tr.make(trace, "cpu", n, seed)
                    for p in STOCK:
                        at.setdefault(p, []).append(run_one(jobs, load * cap, p, None, fair_env, seed))
                    for v, env in VARIANTS.items():
                        for aw in WEIGHTS:
                            at.setdefault(f"{v}@{aw:g}", []).append(
                                run_one(jobs, load * cap, "fair_sched", aw, fair_env + env, seed))
                out.setdefault(str(n), {})[f"{trace}@{load}"] = at
                print(f"  {n} requests, {trace} @ {load}: done", flush=True)
    return out


def analyse(raw: dict[str, Any], default_aw: float) -> dict[str, Any]:
    def m(runs: list[dict[str, float]], k: str) -> float:
        return statistics.fmean(x[k] for x in runs)

    noise: dict[str, Any] = {}
    sweep: dict[str, Any] = {}
    for n, cells in raw.items():
        for cell, at in cells.items():
            base = [x["p99"] for x in at["fcfs"]]
            named = {"fair_sched": f"default@{default_aw:g}", "shortest-prefill-first": "shortest-prefill-first",
                     "hrrn": "hrrn"}
            noise.setdefault(n, {})[cell] = {p: noise_stats([x["p99"] for x in at[k]], base) for p, k in named.items()}
            best = min(m(at[p], "mean") for p in STOCK)

            def point(k: str) -> list[float]:
                return [m(at[k], "mean") / best, *(m(at[k], f) / m(at["fcfs"], f) for f in ("p99", "tpot", "long_mean")),
                        m(at[k], "tail_long")]
            sweep.setdefault("stock", {}).setdefault(n, {})[cell] = {p: point(p) for p in STOCK}
            for v in VARIANTS:
                sweep.setdefault(v, {}).setdefault(n, {})[cell] = {f"{aw:g}": point(f"{v}@{aw:g}") for aw in WEIGHTS}
    held = {v: {n: {f"{aw:g}": [sum(c[f"{aw:g}"][0] <= 1.0 and c[f"{aw:g}"][1] <= 1.0 for c in cells.values()),
                                sum(c[f"{aw:g}"][0] <= 1.0 and c[f"{aw:g}"][1] <= 1.0 and c[f"{aw:g}"][2] <= 1.3
                                    for c in cells.values())] for aw in WEIGHTS}
                for n, cells in sweep[v].items()} for v in VARIANTS}
    frontier = {v: {n: {cell: best_feasible(row) for cell, row in cells.items()} for n, cells in sweep[v].items()}
                for v in VARIANTS}
    return {"noise": noise, "sweep_fields": list(FIELDS), "sweep": sweep,
            "cells_held_by_age_weight": held, "cells_held_fields": ["mean and p99", "mean, p99 and tpot <= 1.3"],
            "lowest_p99_with_mean_held": frontier}


def best_feasible(row: dict[str, list[float]]) -> dict[str, Any]:
    """Over the age_weights of one cell: the lowest mean ratio, and the lowest P99 ratio among the
    settings that hold mean <= best stock (age_weight None: no setting holds the mean)."""
    ok = [(v[1], aw, v[2]) for aw, v in row.items() if v[0] <= 1.0]
    p99, aw, tpot = min(ok) if ok else (None, None, None)
    return {"min_mean": min(v[0] for v in row.values()), "age_weight": aw, "p99": p99, "tpot": tpot}


def print_tables(a: dict[str, Any], dw: str) -> None:
    print("P99 / fcfs P99 per seed: median [P10-P90]; ratio of all-seed means; seeds 0-2; P(3-seed mean > 1)")
    cols = [(n, p) for p in ("fair_sched", "shortest-prefill-first", "hrrn") for n in a["noise"]]
    print(f"{'cell':17s}" + "".join(f"{p[:10] + ' @' + n:>34s}" for n, p in cols))
    for cell in a["noise"][str(SIZES[0])]:
        row = ""
        for n, p in cols:
            s = a["noise"][n][cell][p]
            row += (f"{s['median']:.2f} [{s['p10']:.2f}-{s['p90']:.2f}] {s['ratio_of_means']:.2f} {s['seeds_0_2']:.2f} "
                    f"{s['miss_3seed']:4.0%}").rjust(34)
        print(f"{cell:17s}" + row)
    for v in VARIANTS:
        for n, cells in a["sweep"][v].items():
            print(f"\nage_weight sweep ({v}), {n} requests: mean / best stock, P99 / fcfs, TPOT / fcfs (seed means); "
                  f"tail = share of long prompts at >= P99, fcfs / aw {dw}")
            print(f"{'cell':17s}" + "".join(f"{'aw ' + k:>16s}" for k in [f"{w:g}" for w in WEIGHTS]) + "   tail")
            for cell, row in cells.items():
                st = a["sweep"]["stock"][n][cell]["fcfs"]
                print(f"{cell:17s}" + "".join(f"{x[0]:4.2f}/{x[1]:4.2f}/{x[2]:4.2f}".rjust(16) for x in row.values())
                      + f"   {st[4]:.2f}/{row[dw][4]:.2f}")
            held = a["cells_held_by_age_weight"][v][n].values()
            print(f"{'held (+tpot)':17s}" + "".join(f"{h[0]:d} ({h[1]:d})".rjust(16) for h in held))


def doc_table(doc: dict[str, Any]) -> str:
    a = doc["metrics"]
    lo, hi = (str(n) for n in SIZES)
    sw, ds0 = a["sweep"]["default"][lo], a["sweep"]["decode_share_0"][lo]
    dw = f"{doc['default_age_weight']:g}"

    def f(n: str, cell: str) -> str:
        s = a["noise"][n][cell]["fair_sched"]
        return f"{s['median']:.2f} [{s['p10']:.2f}-{s['p90']:.2f}], {s['ratio_of_means']:.2f}, {s['miss_3seed']:.0%}"
    lines = [f"| trace @ load | P99 / fcfs, {lo} req: per seed median [P10-P90], {doc['seeds']}-seed mean, 3-seed miss "
             f"| same, {hi} req | 3-seed miss, {lo} req: SPF / hrrn | seeds 0-2, {lo} req "
             f"| long share at >= P99: fcfs / ours | P99 / fcfs at age_weight 0; 1-1e6 "
             f"| decode_share 0, age_weight {dw}: mean / P99 / TPOT |", "|---|---|---|---|---|---|---|---|"]
    for cell, n in a["noise"][lo].items():
        p99s = [v[1] for aw, v in sw[cell].items() if aw != "0"]  # age_weight 0: the arrival order
        d = ds0[cell][dw]
        lines.append(f"| {cell.replace('@', ' ')} | {f(lo, cell)} | {f(hi, cell)} | "
                     f"{n['shortest-prefill-first']['miss_3seed']:.0%} / {n['hrrn']['miss_3seed']:.0%} | "
                     f"{n['fair_sched']['seeds_0_2']:.2f} | "
                     f"{a['sweep']['stock'][lo][cell]['fcfs'][4]:.2f} / {sw[cell][dw][4]:.2f} | "
                     f"{sw[cell]['0'][1]:.2f}; {min(p99s):.2f}-{max(p99s):.2f} | {d[0]:.2f} / {d[1]:.2f} / {d[2]:.2f} |")
    held = a["cells_held_by_age_weight"]
    lines += ["", "| cells with mean and P99 held (and TPOT too) | " + " | ".join(f"aw {k}" for k in held["default"][lo]) + " |",
              "|---|" + "---|" * len(held["default"][lo])]
    lines += [f"| {v.replace('_', ' ')}, {n} req | " + " | ".join(f"{h[0]} ({h[1]})" for h in held[v][n].values()) + " |"
              for v in VARIANTS for n in held[v]]
    return "\n".join(lines) + "\n"


def render(text: str, doc: dict[str, Any]) -> str:
    return replace_generated(text, "sim-p99", doc_table(doc), "python benchmarks/fair_sched/sim_p99_study.py "
                             "--write-doc", "docs/fair_sched_studies.md")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--fair-env", nargs="*", default=[], help="option=value for the plugin's config (not age_weight)")
    ap.add_argument("--write-doc", action="store_true", help="only rewrite the docs table from the recorded JSON")
    args = ap.parse_args()
    path = result_path("fair_sched", "sim_p99_study")
    if not args.write_doc:
        t0 = time.time()
        raw = collect(args.seeds, args.fair_env)
        aw = grid.config_from(args.fair_env).age_weight
        a = analyse(raw, aw)
        print_tables(a, f"{aw:g}")
        cmd = f"python benchmarks/fair_sched/sim_p99_study.py --seeds {args.seeds}" + (
            " --fair-env " + " ".join(args.fair_env) if args.fair_env else "")
        record("fair_sched", "sim_p99_study", cmd, round_floats(a, 4), shared="shared 2-core; the simulation is deterministic",
               kind="simulation (CPU costs, chunk 128)", seeds=args.seeds, default_age_weight=aw, requests_per_run=list(SIZES),
               age_weights=list(WEIGHTS), long_prompt_over_tokens=LONG, wall_s=round(time.time() - t0, 1))
        print(f"wrote {path}")
    text = DOC.read_text(encoding="utf-8")
    if generated_block("sim-p99").search(text):
        new = render(text, load_summary(path))
        if new != text:
            DOC.write_text(new, encoding="utf-8")
            print(f"updated {DOC}")


if __name__ == "__main__":
    main()
