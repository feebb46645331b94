"""What-if (a model, not a measurement): fair_sched with one partial prefill (the default) against
`max_partial_prefills` 2, on the simulated clock of `sim_engine.py`, over the trace family at the
CPU chunk sizes (128, 512; CPU costs) and the GPU ones (2048, 8192; H200-fitted costs). Both
settings run the same traces and seeds; the summary holds, per cell, fair_sched's target ratios for
each setting and whether all held, and the docs table is generated from it.

    python benchmarks/fair_sched/sim_max_partial.py --seeds 10            # run, record, print
    python benchmarks/fair_sched/sim_max_partial.py --write-doc           # table in docs/fair_sched_studies.md
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402
import targets  # noqa: E402

from kllm_plugins.bench.record import build_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "fair_sched" / "sim_max_partial.json"
DOC = ROOT / "docs" / "fair_sched_studies.md"
SCALES = (("cpu", "", 128), ("cpu", "", 512), ("production", "h200", 2048), ("production", "h200", 8192))
SETTINGS = (1, 2)
TARGETS = tuple(t[0] for t in targets.TARGETS)


def run(seeds: int, requests: int) -> dict[str, Any]:
    per: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scale, costs, chunk in SCALES:
            for mp in SETTINGS:
                args = SimpleNamespace(scale=scale, costs=costs, chunk=chunk, requests=requests, seeds=seeds,
                                       fair_env=[f"max_partial_prefills={mp}"], out=os.path.join(tmp, f"{chunk}_{mp}.json"))
                doc = grid.run_sim_grid(args)
                per[f"{chunk}:{mp}"] = {cell: v["fair_sched"] for cell, v in doc["metrics"].items()}
    return build_summary(f"python benchmarks/fair_sched/sim_max_partial.py --seeds {seeds} --requests {requests}", per,
                         shared=grid.SIM_SHARED, seeds=seeds, requests_per_run=requests,
                         kind="simulation (CPU costs at 128 and 512; H200-fitted costs at 2048 and 8192)")


def table(summary: dict[str, Any]) -> str:
    m = summary["metrics"]
    cols = ("mean", "short P90", "P99", "long mean", "TPOT")
    head = ["| chunk | trace @ load | " + " | ".join(f"{c}: 1 / 2" for c in cols) + " | all held: 1 / 2 |",
            "|" + "---|" * (len(cols) + 3)]
    body = []
    for _, _, chunk in SCALES:
        one, two = m[f"{chunk}:1"], m[f"{chunk}:2"]
        for cell in one:
            pairs = [f"{one[cell][k]:.2f} / {two[cell][k]:.2f}" for k in TARGETS[:5]]
            body.append(f"| {chunk} | {cell.replace('@', ' @ ')} | " + " | ".join(pairs)
                        + f" | {'yes' if one[cell]['all_met'] else 'no'} / {'yes' if two[cell]['all_met'] else 'no'} |")
    counts = ", ".join(f"chunk {c}: {sum(v['all_met'] for v in m[f'{c}:1'].values())} / "
                       f"{sum(v['all_met'] for v in m[f'{c}:2'].values())} of {len(m[f'{c}:1'])}"
                       for _, _, c in SCALES)
    return "\n".join(head + body) + f"\n\nCells with every target held (1 / 2 partial prefills): {counts}.\n"


def render(text: str, summary: dict[str, Any]) -> str:
    from kllm_plugins.plugin_docs import replace_generated

    return replace_generated(text, "sim-max-partial", table(summary),
                             "python benchmarks/fair_sched/sim_max_partial.py --write-doc", "docs/fair_sched_studies.md")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--write-doc", action="store_true", help="only rewrite the table from the recorded summary")
    a = ap.parse_args()
    return grid.record_or_write_doc(a.write_doc, OUT, DOC, lambda: run(a.seeds, a.requests), lambda s: table(s), render)

if __name__ == "__main__":
    sys.exit(main())
