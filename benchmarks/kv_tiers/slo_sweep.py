"""Throughput at a TTFT SLO for several SLO values, from a recorded bench_tiers.py result (not
collected by pytest). bench_tiers.py records, per setup, trace and open-loop rate, each repeat's
throughput and TTFT percentile; the throughput at an SLO is, per repeat, the highest rate step's
throughput whose percentile is within the SLO (0 if none), then the median over repeats with
[min, max] and the ratio to L1 only. No new measurement: the same cells read with other SLOs.

    python benchmarks/kv_tiers/slo_sweep.py benchmarks/results/kv_tiers_long.json --slos 2,3,4,6,8
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any


def at_slo(run: dict[str, Any], slo_s: float) -> list[float]:
    """Per repeat: the highest step throughput whose TTFT percentile meets `slo_s`."""
    steps = run["open_loop"]
    if not steps:
        return []
    reps = len(steps[0]["throughput_req_s"]["repeats"])
    out = []
    for r in range(reps):
        ok = [s["throughput_req_s"]["repeats"][r] for s in steps if s["ttft_p90_s"]["repeats"][r] <= slo_s]
        out.append(max(ok) if ok else 0.0)
    return out


def sweep(doc: dict[str, Any], slos: list[float]) -> list[dict[str, Any]]:
    rows = []
    for trace in dict.fromkeys(r["trace"] for r in doc["runs"]):
        runs = {r["setup"]: r for r in doc["runs"] if r["trace"] == trace}
        for slo in slos:
            per = {n: at_slo(r, slo) for n, r in runs.items()}
            base = statistics.median(per["l1_only"]) if per.get("l1_only") else 0.0
            row: dict[str, Any] = {"trace": trace, "slo_s": slo}
            for n, v in per.items():
                med = statistics.median(v) if v else 0.0
                row[n] = {"median": med, "min": min(v, default=0.0), "max": max(v, default=0.0), "repeats": v,
                          "vs_l1_only": med / base if base else None}
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--slos", default="2,3,4,6,8")
    a = ap.parse_args()
    doc = json.loads(open(a.result).read())
    for row in sweep(doc, [float(x) for x in a.slos.split(",")]):
        cells = []
        for n in ("l1_only", "hicache", "kv_tiers"):
            if n in row:
                c = row[n]
                ratio = f" x{c['vs_l1_only']:.2f}" if c["vs_l1_only"] is not None else ""
                cells.append(f"{n} {c['median']:.2f} [{c['min']:.2f},{c['max']:.2f}]{ratio}")
        print(f"{row['trace'][:40]:40} SLO P90<={row['slo_s']:g}s: " + "; ".join(cells))


if __name__ == "__main__":
    main()
