"""Would a smaller prefill budget while requests decode (Sarathi-Serve's token budget) bring TPOT
within issue 27's 1.3x fcfs without losing the TTFT targets? (a model, not a measurement)

With SGLang's mixed chunk every running request decodes one token per prefill pass, so a decoding
request's TPOT is about the length of a pass. Sarathi-Serve bounds that length with a token budget
per pass; neither SGLang 0.5.23 nor fair_sched has one (the chunk is fixed). This models it on the
H100 cells of `sim_frontier.py` (same traces, loads, seeds, KV pool and stock baselines): a
`decode_chunk` of a quarter or a half of the chunk caps every pass that has requests decoding,
under stock shortest-prefill-first, hrrn and fcfs with mixed chunk and under fair_sched with
`mixed_decode` (its defaults, and with `short_extra_tokens` 0).

A smaller pass costs its fixed overhead more often. The H100 model's 10 ms a pass is an
assumption, not a measurement (its fit saw only whole 2048-token chunks), so every candidate also
runs on a split with 3 ms a pass and the same cost for a whole 2048-token chunk at short context.

    python benchmarks/fair_sched/sim_decode_chunk.py [--seeds 8] [--chunks 2048 8192]
    python benchmarks/fair_sched/sim_decode_chunk.py --write-doc   # table in docs/fair_sched_studies.md
"""
from __future__ import annotations

import dataclasses
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402
import sim_engine as se  # noqa: E402
import sim_frontier as sf  # noqa: E402
import targets  # noqa: E402
import traces as tr  # noqa: E402

from kllm_plugins.bench.record import build_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "fair_sched" / "sim_decode_chunk_h100_8l.json"
DOC = ROOT / "docs" / "fair_sched_studies.md"
SHARES = (0, 4, 2)  # decode chunk = chunk / share (0: none, the chunk itself)
FAIR_MIXED = ("mixed_decode=1",)
CANDIDATES = (("shortest-prefill-first + mixed chunk", "shortest-prefill-first", None),
              ("hrrn + mixed chunk", "hrrn", None), ("fcfs + mixed chunk", "fcfs", None),
              ("fair_sched + mixed_decode", "fair_sched", FAIR_MIXED),
              ("fair_sched + mixed_decode, short_extra_tokens=0", "fair_sched", (*FAIR_MIXED, "short_extra_tokens=0")))
PASS_BASES = (0.010, 0.003)  # seconds of fixed cost a pass: the model's assumption, and a smaller split


def costs(base: float) -> se.Costs:
    """The H100 model with `base` seconds a pass, the per-token cost moved so that a 2048-token chunk
    at short context costs what it does in the fitted model."""
    c = se.COSTS["h100_8l"]
    return dataclasses.replace(c, base=base, per_token=c.per_token + (c.base - base) / 2048)


def share_name(share: int) -> str:
    return "none" if not share else f"chunk/{share}"


def ratios_of(m: dict[str, Any], label: str, share: int) -> dict[str, float]:
    """A candidate's ratio per target (`targets.TARGETS` names) in one cell's metrics."""
    return dict(zip((t[0] for t in targets.TARGETS), m["candidates"][label][share_name(share)]))


def meets(ratios: dict[str, float]) -> bool:
    """Every target holds."""
    return all(targets.holds(metric, limit, ratios[name]) for name, metric, limit, _ in targets.TARGETS)


def cell(args: tuple[str, int, float, int, float]) -> dict[str, Any]:
    """One trace @ chunk @ load on one cost split: the stock baselines, then every candidate."""
    trace, chunk, load, seeds, base = args
    cm = costs(base)
    cap, rate, jobs, stock = sf.baselines(trace, chunk, load, seeds, cm)
    out: dict[str, dict[str, list[float]]] = {}
    for label, policy, env in CANDIDATES:
        for share in SHARES:
            pol = se.EngineWith(policy, mixed=env is None, decode_chunk=chunk // share if share else 0)
            ratios = sf._checked(label, sf._means(jobs, rate, chunk, pol, env, cm), stock)["ratios"]
            out.setdefault(label, {})[share_name(share)] = [ratios[t[0]] for t in targets.TARGETS]
    return {"capacity_req_s": round(cap, 4), "candidates": out}


def run(seeds: int, chunks: list[int], workers: int) -> dict[str, Any]:
    keys = [(t, c, load, seeds, b) for b in PASS_BASES for c in chunks for t in tr.TRACES for load in grid.LOADS]
    with ProcessPoolExecutor(max_workers=workers) as ex:
        cells = list(ex.map(cell, keys))
    metrics = {f"{t}@{c}@{load}@{b * 1000:g}ms": v for (t, c, load, _, b), v in zip(keys, cells)}
    cmd = f"python benchmarks/fair_sched/sim_decode_chunk.py --seeds {seeds} --chunks {' '.join(map(str, chunks))}"
    return build_summary(cmd, metrics, shared=grid.SIM_SHARED, seeds=seeds, requests_per_seed=30,
                         costs="h100_8l, 10 ms and 3 ms a pass", pool_tokens=sf.POOL, cells_met=cells_met(metrics),
                         kind="simulation (costs fitted to the 8-layer H100 run): a decode chunk nobody ships")


def cells_met(metrics: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per cost split, in how many cells each candidate meets every target."""
    out: dict[str, dict[str, int]] = {}
    for key, m in metrics.items():
        split = out.setdefault(key.rsplit("@", 1)[1], {})
        for label, _, _ in CANDIDATES:
            for share in SHARES:
                n = f"{label}, decode chunk {share_name(share)}"
                split[n] = split.get(n, 0) + meets(ratios_of(m, label, share))
    return out


def table(summary: dict[str, Any]) -> str:
    """Mean (vs the best stock policy) / P99 / TPOT (vs fcfs) per cell and decode chunk, for stock
    shortest-prefill-first with mixed chunk and fair_sched with mixed_decode and no riders' extra."""
    shown = (CANDIDATES[0][0], CANDIDATES[4][0])
    head = ["| trace @ chunk @ load @ pass overhead | " + " | ".join(
        f"{'SPF + mixed' if i == 0 else 'fair_sched, extra 0'}: {share_name(s)}"
        for i in range(2) for s in SHARES) + " |", "|---" * (1 + 2 * len(SHARES)) + "|"]
    body = []
    for key, m in summary["metrics"].items():
        cols = [ratios_of(m, label, s) for label in shown for s in SHARES]
        body.append(f"| {key.replace('@', ' @ ')} | " + " | ".join(
            f"{r[sf.MEAN]:.2f} / {r[sf.P99]:.2f} / {r[sf.TPOT]:.2f}" + (" ✓" if meets(r) else "") for r in cols) + " |")
    met = []
    for split, counts in summary["cells_met"].items():
        cells = sum(1 for k in summary["metrics"] if k.endswith("@" + split))
        best = max(counts.values())
        met.append(f"at {split} a pass, cells of {cells} where every target holds: "
                   + "; ".join(f"{label.replace('shortest-prefill-first', 'SPF')} "
                               + " / ".join(str(counts[f"{label}, decode chunk {share_name(s)}"]) for s in SHARES)
                               for label, _, _ in CANDIDATES)
                   + f" (most: {best})")
    return "\n".join(head + body + ["", "Decode chunk none / chunk/4 / chunk/2, " + "; ".join(met) + "."]) + "\n"


render = grid.studies_renderer("sim-decode-chunk", table, "benchmarks/fair_sched/sim_decode_chunk.py")


def main() -> int:
    return grid.cells_search_main(__doc__, OUT, DOC, run, table, render)


if __name__ == "__main__":
    sys.exit(main())
