"""Benchmark helper: the tables of docs/fair_sched.md on one huge prompt in flight, generated from
the recorded summaries: `long_in_flight.json` (real CPU servers, long_in_flight.py) and
`long_in_flight_gpu_*.json` (benchmarks/gpu/fair_sched_long_gpu.py), one table each.

    python benchmarks/fair_sched/long_in_flight_table.py [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import options_label  # noqa: E402

from kllm_plugins.plugin_docs import replace_generated, rewrite_doc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "fair_sched"
DOC = ROOT / "docs" / "fair_sched.md"
COLUMNS = (("short_mean", "short mean TTFT"), ("short_p90", "short P90"), ("medium_mean", "medium mean TTFT"),
           ("long_ttft", "long TTFT"), ("wall", "wall"))


def label(name: str, setup: dict[str, Any]) -> str:
    """A setup's name with the fair_sched options its variant sets (`max_partial_prefills=2`)."""
    opts = options_label(setup.get("env", {}))
    return f"{name} ({opts})" if opts and name != "fair_sched" else name


def _cell(row: dict[str, Any], metric: str, absolute: bool) -> str:
    c = row.get(metric)
    if not c:
        return "-"
    if absolute:
        s = c["s"]
        return f"{s['median']:.2f} s" + (f" [{s['min']:.2f}-{s['max']:.2f}]" if s["min"] != s["max"] else "")
    r = c.get("vs_fcfs")
    if not r:
        return "-"
    return f"{r['ratio']:.2f}x" + (f" [{r['min']:.2f}-{r['max']:.2f}]" if r["min"] != r["max"] else "")


def table(d: dict[str, Any]) -> str:
    """fcfs in seconds, every other setup as its ratio of seed medians to fcfs [per-seed min-max];
    a setup with no run names its failures."""
    head = ("| setup | runs | " + " | ".join(h for _, h in COLUMNS)
            + " | mediums before the long prompt | outputs = fcfs |\n|" + "---|" * (len(COLUMNS) + 4))
    lines = [head]
    for name, row in d["metrics"].items():
        lab = label(name, d.get("setups", {}).get(name, {}))
        if not row["runs"]:
            why = "server exited" if any(r.get("setup") == name for r in d.get("runs", [])) else "no run"
            lines.append(f"| {lab} | 0 of {row['failed']} | {why} |" + " |" * (len(COLUMNS) + 1))
            continue
        cells = [_cell(row, m, name == "fcfs") for m, _ in COLUMNS]
        mb = row["medium_before_long"]["median"]
        same = {True: "yes", False: "no", None: "-"}[row["same_as_fcfs"]]
        runs = f"{row['runs']}" + (f" ({row['failed']} failed)" if row["failed"] else "")
        lines.append(f"| {lab} | {runs} | " + " | ".join(cells) + f" | {mb:g} of {d['settings']['mediums']} | {same} |")
    return "\n".join(lines) + "\n"


def gpu_tables(folder: Path = RESULTS) -> str:
    out = []
    for path in sorted(folder.glob("long_in_flight_gpu_*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        s = d["settings"]
        out.append(f"`{path.name}`: {d['machine'].get('gpu', '?').replace('NVIDIA ', '')}, {d['model']}, "
                   f"{s['long_tokens']:,}-token prompt, chunk {s['chunk']}, {s['seeds']} seeds, {s['shorts']} shorts of "
                   f"{s['short_len'][0]}-{s['short_len'][1]} tokens at {s['rate']:g}/s, {s['mediums']} mediums of "
                   f"{s['medium_len'][0]:,}-{s['medium_len'][1]:,}, commit {d['commit']}\n\n" + table(d))
    return "\n".join(out) or "no GPU run recorded\n"


def render(text: str, folder: Path = RESULTS) -> str:
    cmd = "python benchmarks/fair_sched/long_in_flight_table.py --write"
    cpu = json.loads((folder / "long_in_flight.json").read_text(encoding="utf-8"))
    text = replace_generated(text, "long-in-flight-cpu", table(cpu), cmd, "docs/fair_sched.md")
    return replace_generated(text, "long-in-flight-gpu", gpu_tables(folder), cmd, "docs/fair_sched.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the tables in docs/fair_sched.md")
    a = ap.parse_args()
    if a.write:
        rewrite_doc(DOC, render)
    else:
        sys.stdout.write(table(json.loads((RESULTS / "long_in_flight.json").read_text(encoding="utf-8"))) + "\n"
                         + gpu_tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())
