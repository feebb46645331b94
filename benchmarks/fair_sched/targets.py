"""Benchmark helper (not library code): issue 27's targets for fair_sched, checked on seed means,
one definition for the simulated grid (`grid.py`), the real-server grid (`server_grid.py`) and the
GPU rows (`benchmarks/gpu/fair_sched_gpu.py`).

`m[policy][metric]` holds seed means under the metric names `mean`, `short_p90`, `p99`,
`long_mean`, `tpot` and `throughput`. Mean TTFT and short-prompt P90 are compared with the best
stock policy present (a stock server that died is simply absent), the rest with fcfs. A ratio that
is not a number (no long prompt in the runs) has nothing to miss.
"""
from __future__ import annotations

import math
from typing import Any

STOCK = ("fcfs", "lpm", "shortest-prefill-first", "hrrn")
# (target, metric, limit, against: "best" = the best stock policy on that metric, else a policy)
TARGETS = (("mean <= best stock", "mean", 1.0, "best"), ("short p90 <= best stock", "short_p90", 1.0, "best"),
           ("p99 <= fcfs", "p99", 1.0, "fcfs"), ("long mean <= 1.25x fcfs", "long_mean", 1.25, "fcfs"),
           ("tpot <= 1.3x fcfs", "tpot", 1.3, "fcfs"), ("throughput >= 0.98x fcfs", "throughput", 0.98, "fcfs"))


def holds(metric: str, limit: float, v: float | None) -> bool:
    """Whether ratio `v` of `metric` is within `limit` (throughput at or above, the rest at or below);
    a ratio that is not a number (None once recorded in JSON) has nothing to miss."""
    return v is None or math.isnan(v) or (v >= limit if metric == "throughput" else v <= limit)


def check(m: dict[str, dict[str, float]], ours: str = "fair_sched") -> dict[str, dict[str, Any]]:
    """Each target: its ratio (rounded to 3 places), limit, the policy it is against, and whether it held."""
    stock = [p for p in STOCK if p in m]
    out: dict[str, dict[str, Any]] = {}
    for name, metric, limit, against in TARGETS:
        who = min(stock, key=lambda p: m[p][metric]) if against == "best" else against
        v = m[ours][metric] / m[who][metric]
        out[name] = {"value": round(v, 3), "target": limit, "against": who, "met": holds(metric, limit, v)}
    return out
