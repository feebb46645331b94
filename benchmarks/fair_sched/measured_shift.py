"""Where the saved TTFT goes, measured: the accounting of `sim_latency_shift.py` on real servers.

The model's accounting (mean end to end = mean TTFT + mean decode time; the **shift** = decode time
a policy adds over fcfs's / TTFT it saves against fcfs; issue 27's mean and TPOT targets hold
together only at a shift of at most `allowed decode growth / needed saving`) applied to every
recorded run that measured end-to-end and decode time:

* the H100 runs of `benchmarks/gpu/fair_sched_gpu.py` (`gpu_*.json` whose cells carry
  `decode_s_mean`, recorded from 2026-12-07), beside the model's shift for the same cell
  (`sim_latency_shift_h100_8l.json`);
* the real CPU servers of `server_grid.py` (files whose seed means carry `decode`).

The best stock policy (the mean target's reference) is taken among the stock servers that stayed
up in the cell, as the targets are.

    python benchmarks/fair_sched/measured_shift.py            # print the table
    python benchmarks/fair_sched/measured_shift.py --write    # rewrite it in docs/fair_sched_studies.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sim_latency_shift as sls  # noqa: E402
from server_table import gpu_label  # noqa: E402

from kllm_plugins.plugin_docs import replace_generated, rewrite_doc  # noqa: E402

RESULTS = sls.sf.ROOT / "benchmarks" / "results" / "fair_sched"
DOC = sls.DOC
STOCK = ("fcfs", "lpm", "shortest-prefill-first", "hrrn")
SHOWN = ("shortest-prefill-first", "hrrn", "fair_sched")
MODELLED = "H100, 8 layers"  # the card and model the simulated clock is costed for (`COSTS["h100_8l"]`)
# a GPU cell's figure (seed mean) for each key of the accounting
GPU_KEYS = {"mean": "ttft_s_mean", "e2e": "e2e_s_mean", "decode": "decode_s_mean", "tpot": "tpot_s_mean",
            "p99": "ttft_s_p99"}


def gpu_cells(d: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """`trace@chunk@load` -> policy -> the accounting's keys, for a GPU file's cells that measured
    decode time; servers that exited in a cell are left out, as the targets leave them out."""
    out = {}
    for key, cell in d["metrics"].items():
        gone = set(cell.get("exited", ()))
        pols = {p: {k: cell[p][g]["mean"] for k, g in GPU_KEYS.items()} for p, f in cell.items()
                if isinstance(f, dict) and "decode_s_mean" in f and p not in gone}
        if "fcfs" in pols:
            out[key] = pols
    return out


def cpu_cells(d: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """The same for a real-CPU-server grid's loads whose seed means carry `decode` (a server that
    exited is already out of them: `server_grid.py` compares the others on the same seeds)."""
    out = {}
    for load, c in d["metrics"]["cells"].items():
        pols = {p: m for p, m in c["seed_mean"].items() if "decode" in m}
        if "fcfs" in pols:
            out[f"{d['trace']}@{d['chunk']}@{load}"] = pols
    return out


def measured(folder: Path = RESULTS) -> list[tuple[str, str, dict[str, Any]]]:
    """(where, cell, accounting) for every measured cell, GPU files first, each file's cells in order;
    `where` is the GPU file's card (`server_table.gpu_label`), `CPU`, or `CPU, prefill/decode
    disaggregated` (`server_grid.py --pd`)."""
    rows = []
    for pattern, cells in (("gpu_*.json", gpu_cells), ("server_*.json", cpu_cells), ("cpu_shift_*.json", cpu_cells)):
        for p in sorted(folder.glob(pattern)):
            d = json.loads(p.read_text(encoding="utf-8"))
            where = gpu_label(d) if cells is gpu_cells else "CPU, prefill/decode disaggregated" if d.get("pd") else "CPU"
            for key, pols in cells(d).items():
                stock = {s: pols[s] for s in STOCK if s in pols}
                rows.append((where, key, {"file": p.name, "fcfs": pols["fcfs"], "budget": sls.budget(stock),
                                          "policies": {q: sls.account(m, pols["fcfs"]) for q, m in pols.items()
                                                       if q != "fcfs"}}))
    return rows


def _shift(a: dict[str, Any] | None) -> str:
    if a is None:
        return "-"
    return (f"{sls._fmt(a['shift'])} ({a['mean_vs_fcfs']:.2f} / {a['e2e_vs_fcfs']:.2f} / "
            f"{a['tpot_vs_fcfs']:.2f})")


def table(folder: Path = RESULTS, model: dict[str, Any] | None = None) -> str:
    """Per measured cell: fcfs's TTFT and decode time, the shift the targets allow, each shown
    policy's shift with its mean TTFT / end-to-end / TPOT ratios to fcfs (then the other fair_sched
    settings and mixed-chunk stock orders the run had), and, on the card the model is costed for
    (`MODELLED`), the model's shift allowed and its shifts for the same policies."""
    if model is None:
        model = json.loads(sls.OUT.read_text(encoding="utf-8"))["metrics"]
    names = [sls.SHORT.get(p, p) for p in SHOWN]
    head = ["| where | trace @ chunk @ load | fcfs TTFT / decode (s) | shift allowed | "
            + " | ".join(f"{n}: shift (TTFT / e2e / TPOT vs fcfs)" for n in names)
            + " | other settings: shift (TTFT / e2e / TPOT vs fcfs) | model: shift allowed; " + " / ".join(names)
            + " | file |", "|---" * (7 + len(names)) + "|"]
    body = []
    for where, key, c in measured(folder):
        f, m = c["fcfs"], model.get(key) if where == MODELLED else None
        sim = "-" if m is None else (f"{sls._fmt(m['budget']['shift_allowed'])}; " + " / ".join(
            sls._fmt(m["policies"][p]["shift"]) for p in SHOWN))
        others = "; ".join(f"{p.split('/')[-1]} {_shift(a)}" for p, a in c["policies"].items()
                           if p not in SHOWN and p not in STOCK) or "-"
        body.append(f"| {where} | {key.replace('@', ' @ ')} | {f['mean']:.2f} / {f['decode']:.2f} | "
                    f"{sls._fmt(c['budget']['shift_allowed'])} | "
                    + " | ".join(_shift(c["policies"].get(p)) for p in SHOWN) + f" | {others} | {sim} | {c['file']} |")
    return "\n".join(head + body) + "\n"


def render(text: str, folder: Path = RESULTS) -> str:
    return replace_generated(text, "measured-shift", table(folder), "python benchmarks/fair_sched/measured_shift.py "
                             "--write", "docs/fair_sched_studies.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/fair_sched_studies.md")
    if ap.parse_args().write:
        rewrite_doc(DOC, render)
    else:
        print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
