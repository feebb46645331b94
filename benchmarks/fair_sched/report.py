"""Benchmark helper (not library code): the fair_sched benchmark's table (seeds averaged, ratio to
fcfs), its check of the issue's targets, the TTFT distribution plot and the JSON/RESULTS.md output."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from kllm_plugins.bench.plot import figure

POLICIES = ("fcfs", "lpm", "shortest-prefill-first", "hrrn", "fair_sched")

METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTFT mean", ("ttft_s", "mean")), ("TTFT p50", ("ttft_s", "p50")), ("TTFT p90", ("ttft_s", "p90")),
    ("TTFT p95", ("ttft_s", "p95")), ("TTFT p99", ("ttft_s", "p99")),
    ("short TTFT mean", ("ttft_short_s", "mean")), ("short TTFT p90", ("ttft_short_s", "p90")),
    ("short TTFT p99", ("ttft_short_s", "p99")), ("long TTFT mean", ("ttft_long_s", "mean")),
    ("long TTFT max", ("ttft_long_s", "max")), ("long TTFT/solo max", ("long_ttft_over_solo", "max")),
    ("short-in-long mean", ("ttft_short_during_long_s", "mean")), ("TPOT mean", ("tpot_s", "mean")),
    ("throughput req/s", ("throughput_req_s",)),
)


def value(row: dict[str, Any], path: tuple[str, ...]) -> float:
    v: Any = row
    for p in path:
        v = v.get(p, float("nan")) if isinstance(v, dict) else float("nan")
    return float(v)


def seed_mean(runs: list[dict[str, Any]], policy: str, load: float, path: tuple[str, ...]) -> float:
    vals = [value(r, path) for r in runs if r["policy"] == policy and r["load"] == load]
    return statistics.fmean(vals) if vals else float("nan")


def target_checks(runs: list[dict[str, Any]], load: float) -> list[tuple[str, float, str, bool]]:
    """The issue's targets for fair_sched against fcfs (and shortest-prefill-first) at one load,
    on seed-averaged figures: (name, measured, target, met)."""
    def r(path: tuple[str, ...], base: str = "fcfs") -> float:
        return seed_mean(runs, "fair_sched", load, path) / seed_mean(runs, base, load, path)

    checks = [
        ("TTFT mean vs fcfs", r(("ttft_s", "mean")), "<= 0.50", r(("ttft_s", "mean")) <= 0.5),
        ("TTFT p90 vs fcfs", r(("ttft_s", "p90")), "<= 0.25", r(("ttft_s", "p90")) <= 0.25),
        ("TTFT p99 vs fcfs", r(("ttft_s", "p99")), "<= 1.00", r(("ttft_s", "p99")) <= 1.0),
        ("long TTFT mean vs fcfs", r(("ttft_long_s", "mean")), "<= 1.25", r(("ttft_long_s", "mean")) <= 1.25),
        ("TPOT mean vs fcfs", r(("tpot_s", "mean")), "<= 1.30", r(("tpot_s", "mean")) <= 1.3),
        ("throughput vs fcfs", r(("throughput_req_s",)), ">= 0.98", r(("throughput_req_s",)) >= 0.98),
    ]
    if any(x["policy"] == "shortest-prefill-first" and x["load"] == load for x in runs):
        v = r(("ttft_short_s", "p90"), "shortest-prefill-first")
        checks.append(("short TTFT p90 vs SPF", v, "<= 1.00", v <= 1.0))
    return checks


def table(runs: list[dict[str, Any]], loads: list[float]) -> str:
    lines = []
    for load in loads:
        at = [r for r in runs if r["load"] == load]
        policies = [p for p in POLICIES if any(r["policy"] == p for r in at)]
        seeds = sorted({r["seed"] for r in at})
        rate = statistics.fmean(r["rate_req_s"] for r in at) if at else float("nan")
        lines.append(f"load {load} ({rate:.2f} req/s; mean over seeds {seeds}; ratio to fcfs in brackets)")
        lines.append(f"{'metric':20s}" + "".join(f"{p:>26s}" for p in policies))
        for name, path in METRICS:
            base = seed_mean(at, "fcfs", load, path) if "fcfs" in policies else None
            cells = []
            for p in policies:
                v = seed_mean(at, p, load, path)
                cells.append(f"{v:9.3f} [{v / base:5.2f}x]" if base else f"{v:9.3f}")
            lines.append(f"{name:20s}" + "".join(f"{c:>26s}" for c in cells))
        if "fair_sched" in policies and "fcfs" in policies:
            checks = target_checks(runs, load)
            lines.append("targets (fair_sched): " + "; ".join(
                f"{n} {v:.2f} {t} {'MET' if ok else 'NOT MET'}" for n, v, t, ok in checks))
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], requests: dict[str, list[list[Any]]], loads: list[float], path: str, title: str) -> None:
    """TTFT CDF per policy, all / short / long requests, one row per load (seeds pooled)."""
    with figure(path, rows=len(loads), cols=3, size=(15, 4.2 * len(loads)), dpi=100) as axes:
        if axes is not None:
            _draw_cdfs(axes, runs, requests, loads, title)


def _draw_cdfs(axes: Any, runs: list[dict[str, Any]], requests: dict[str, list[list[Any]]], loads: list[float],
               title: str) -> None:
    for row, load in zip(axes, loads):
        for ax, kind in zip(row, ("all", "short", "long")):
            for policy in POLICIES:
                xs = sorted(t for r in runs if r["policy"] == policy and r["load"] == load
                            for k, _, t, _ in requests[r["key"]] if kind in ("all", k))
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (s)")
            ax.set_title(f"{title}, load {load}: {kind} requests")
            ax.grid(True, alpha=0.3)
        row[0].set_ylabel("fraction of requests")
    axes[0][0].legend()


def write_json(path: str, mix: str, command: str, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Merge this mix's runs into the results file (other mixes' runs are kept)."""
    data: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except ValueError:
                data = {}
    if "mixes" not in data:
        data = {"runs": [], "mixes": {}}
    data["runs"] = [r for r in data["runs"] if r.get("mix") != mix] + [
        {k: v for k, v in r.items() if k != "key"} for r in runs]
    data["mixes"][mix] = {"command": command, **meta}
    data["command"] = " && ".join(m["command"] for m in data["mixes"].values())
    data = {"command": data["command"], "mixes": data["mixes"], "runs": data["runs"]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)


def append_results_md(root: str, command: str, text: str, note: str) -> None:
    path = os.path.join(root, "benchmarks", "RESULTS.md")
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"\n## fair_sched ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n`{command}`\n\n"
                 f"```\n{text}\n```\n\n{note}\n")
