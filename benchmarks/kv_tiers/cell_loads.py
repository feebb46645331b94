"""Per rate step, the tokens kv_tiers moved L3 -> L2 (prefetches) and L2 -> L1 (load-backs at admission),
from a bench_tiers `--partial` file (diagnosis, not a recorded benchmark): medians over repeats of the
per-cell deltas of the servers' cumulative counters. A gap that opens with the rate is prefetched KV
that was recomputed anyway.

    python benchmarks/kv_tiers/cell_loads.py benchmarks/results/kv_tiers_long11_cells.json --trace synthetic
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def loads(stats: list[dict[str, Any]]) -> tuple[int, int]:
    """(L3 -> L2, L2 -> L1) tokens so far, both servers."""
    return (sum(s["prefetch_wait"]["loaded_tokens"] for s in stats), sum(s.get("l2_loaded_tokens", 0) for s in stats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("partial")
    ap.add_argument("--trace", default="synthetic", help="cells whose trace name starts with this")
    a = ap.parse_args()
    cells = json.loads(Path(a.partial).read_text())["cells"]
    per_step: dict[Any, list[tuple[int, int, float]]] = {}
    for rep in sorted({c["repeat"] for c in cells if c["setup"] == "kv_tiers"}):
        prev = None
        for c in (c for c in cells if c["setup"] == "kv_tiers" and c["repeat"] == rep):  # in run order
            if not c.get("kv_tiers_after"):
                continue
            now = loads(c["kv_tiers_after"])
            if prev is not None and c["trace"].startswith(a.trace):
                per_step.setdefault(c["step"], []).append((now[0] - prev[0], now[1] - prev[1], c["hit_rate"]["l3"]))
            prev = now
    for step, v in per_step.items():
        print(f"{step}: L3->L2 {statistics.median(x[0] for x in v):.0f}, L2->L1 {statistics.median(x[1] for x in v):.0f} "
              f"tokens, L3 hit {statistics.median(x[2] for x in v):.3f} ({len(v)} repeats)")


if __name__ == "__main__":
    main()
