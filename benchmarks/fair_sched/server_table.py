"""The policy grids' tables in docs/fair_sched.md, built from the recorded summaries: the
real-server grid of `server_grid.py` (`benchmarks/results/fair_sched/server_<trace>_<chunk>.json`,
one row per trace, chunk and load) and the GPU rows of `benchmarks/gpu/fair_sched_gpu.py`
(`gpu_*.json`, one row per trace and chunk; `pd_prefill_gpu_*.json` of its `--prefill-only` runs
apart): fair_sched's ratio of seed means to the best stock
policy (mean TTFT, short-prompt P90) and to fcfs (the rest), `*` on a missed target.

    python benchmarks/fair_sched/server_table.py           # print the table
    python benchmarks/fair_sched/server_table.py --write   # rewrite it in docs/fair_sched.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import mixed_stock, options_label, parse_variant  # noqa: E402

from kllm_plugins.plugin_docs import replace_generated, rewrite_doc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "fair_sched"
DOC = ROOT / "docs" / "fair_sched.md"
PD_GPU = "pd_prefill_gpu_*.json"  # benchmarks/gpu/fair_sched_gpu.py --prefill-only
STOCK = ("fcfs", "lpm", "shortest-prefill-first", "hrrn")
SHORT = {"shortest-prefill-first": "SPF"}
# (target key in the summary, column heading)
COLUMNS = (("mean <= best stock", "mean vs best stock"), ("short p90 <= best stock", "short P90 vs best stock"),
           ("p99 <= fcfs", "P99 vs fcfs"), ("long mean <= 1.25x fcfs", "long mean vs fcfs"),
           ("tpot <= 1.3x fcfs", "TPOT vs fcfs"), ("throughput >= 0.98x fcfs", "throughput vs fcfs"))


def summaries(folder: Path = RESULTS, pd: bool = False) -> list[dict[str, Any]]:
    """The recorded grids, ordered by trace then chunk: on one server each, or (`pd`) with prefill
    and decode disaggregated (`server_grid.py --pd`, a `pd` field)."""
    out = [d for d in (json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("server_*_*.json")))
           if bool(d.get("pd")) == pd]
    return sorted(out, key=lambda d: (str(d["trace"]), int(d["chunk"]), int(d.get("requests_per_run", 0)),
                                      str(d.get("date", ""))))


def rows(summary: dict[str, Any]) -> list[str]:
    out = []
    for load, cell in sorted(summary["metrics"]["cells"].items(), key=lambda kv: float(kv[0])):
        means = cell["seed_mean"]
        best = min((p for p in STOCK if p in means), key=lambda p: means[p]["mean"])
        exited = summary["metrics"].get("servers_exited") or {}
        if exited:  # stock servers that died mid-run are left out of the comparison
            best += f" ({', '.join(sorted(exited))} exited)"
        marks = [f"{cell['targets'][k]['value']:.2f}" + ("" if cell["targets"][k]["met"] else " *")
                 for k, _ in COLUMNS]
        same = outputs_cell(cell["outputs_identical_to_fcfs"])
        out.append(f"| {summary['trace']} | {summary['chunk']} | {load} | {summary.get('requests_per_run', '')} | "
                   f"{summary['seeds']} | "
                   f"{str(summary.get('date', ''))[:10]} | {best} | "
                   + " | ".join(marks) + f" | {same} |")
    return out


def outputs_cell(shares: dict[str, float]) -> str:
    """fair_sched's share of requests whose output equals fcfs's ("yes" when all), then the stock
    policies that differ from fcfs, which show whether fcfs's own output was the odd one."""
    own = shares.get("fair_sched", 1.0)
    text = "yes" if own == 1.0 else f"NO: {100 * own:.1f}%"
    others = [f"{SHORT.get(p, p)} {100 * v:.1f}%" for p, v in shares.items() if p != "fair_sched" and v != 1.0]
    return text + (f" (stock: {', '.join(others)})" if others else "")


def table(folder: Path = RESULTS, pd: bool = False) -> str:
    head = ["| trace | chunk | load | requests | seeds | recorded | best stock (mean) | "
            + " | ".join(h for _, h in COLUMNS) + " | outputs = fcfs |", "|" + "---|" * (len(COLUMNS) + 8)]
    body = [r for s in summaries(folder, pd) for r in rows(s)]
    return "\n".join(head + body) + "\n"


def variant_options(d: dict[str, Any], name: str) -> str:
    """A GPU run's variant `fair_sched/TAG` as its options, e.g. `decode_time_share=0.2`; a stock
    server with mixed chunk (`POLICY+mixed`) as its flag."""
    if mixed_stock(name):
        return "--enable-mixed-chunk"
    env = dict(map(parse_variant, d["settings"].get("variants", []))).get(name)
    return "?" if env is None else options_label(env)


def _in_cell(r: dict[str, Any], trace: str, chunk: str, load: str | None) -> bool:
    """A run (or a run's error) of that trace and chunk, and of that load where the file ran several;
    an error without a trace (a warm-up) belongs to every trace."""
    return (r.get("trace", trace) == trace and str(r["chunk"]) == chunk
            and (load is None or "load" not in r or str(r["load"]) == load))


def pass_timing(d: dict[str, Any], trace: str, chunk: str, policy: str, load: str | None = None) -> str:
    """How the policy's runs timed their passes: `lag N` as recorded (`timing_lag`, GPU drivers since
    the overlap-timing fix b5a7031), else `before fix` (each pass timed as the one before it); `-`
    for a stock server (`POLICY+mixed`), which times nothing."""
    if mixed_stock(policy):
        return "-"
    lags = {r["fair_sched_counters"]["timing_lag"] for r in d.get("runs", [])
            if _in_cell({"trace": "bursty", **r}, trace, chunk, load) and r["policy"] == policy
            and "timing_lag" in r.get("fair_sched_counters", {})}
    return " / ".join(f"lag {int(v)}" for v in sorted(lags)) or "before fix"


def gpu_label(d: dict[str, Any]) -> str:
    """The card of a GPU file, and its layers where fewer than the 8B shape's 32 ("H100, 8 layers")."""
    layers = d["settings"].get("layers", 32)
    return d["machine"]["gpu"].replace("NVIDIA ", "").split()[0] + ("" if layers == 32 else f", {layers} layers")


def exited_cell(policy: str, against: dict[str, Any] | None) -> str:
    """A stock server that exited, with fair_sched's mean and short P90 against it on the seeds it ran
    (recorded by the GPU driver as `exited_stock`), which the targets leave out."""
    if not against:
        return policy
    n = len(against["seeds"])
    figs = ", ".join(f"{label} {against[k]:.2f}" for k, label in (("mean", "mean"), ("short_p90", "short P90"))
                     if k in against)
    return f"{policy} (fair_sched on its {n} seed{'s' if n > 1 else ''}: {figs})"


def gpu_table(folder: Path = RESULTS, pattern: str = "gpu_*.json") -> str:
    """One row per trace and chunk of the GPU runs; stock servers that died are named. `pattern`
    `pd_prefill_gpu_*.json`: the runs of `--prefill-only` (the prefill side of a disaggregated
    pair), whose TPOT is not measured ("-")."""
    head = ["| trace | chunk | load | requests | seeds | GPU | pass timing | best stock (mean) | "
            + " | ".join(h for _, h in COLUMNS) + " | TPOT vs fcfs: SPF / hrrn | stock servers that exited |",
            "|" + "---|" * (len(COLUMNS) + 10)]
    body: list[tuple[str, int, str, str]] = []
    for path in sorted(folder.glob(pattern)):
        d = json.loads(path.read_text(encoding="utf-8"))
        s = d["settings"]
        for key, cell in d["metrics"].items():
            trace, chunk, *at = key.split("@")  # `trace@chunk`, or `trace@chunk@load` where a file ran several loads
            load = at[0] if at else None
            if "targets" not in cell:
                continue
            gpu = gpu_label(d)
            stock_tpot = " / ".join(f"{cell[p]['vs_fcfs']['tpot_s_mean']:.2f}" if "tpot_s_mean" in cell.get(p, {}).get("vs_fcfs", {}) else "-"
                                    for p in ("shortest-prefill-first", "hrrn"))
            # the driver's metrics name the servers that exited before the cell's last seed
            died = [exited_cell(q, cell.get("exited_stock", {}).get(q)) for q in cell.get("exited", [])]
            for ours, t in [("fair_sched", cell["targets"]), *sorted(cell.get("variant_targets", {}).items())]:
                marks = [("-" if t[k]["value"] != t[k]["value"] else f"{t[k]['value']:.2f}" + ("" if t[k]["met"] else " *"))
                         for k, _ in COLUMNS]
                label = trace if ours == "fair_sched" else f"{trace}, {ours} ({variant_options(d, ours)})"
                body.append((trace, int(chunk), load or str(s["load"]), f"| {label} | {chunk} | {load or s['load']} | "
                             f"{s['requests']} | {cell[ours]['seeds']} | {gpu} | {pass_timing(d, trace, chunk, ours, load)} | "
                             f"{t['mean <= best stock']['against']} | " + " | ".join(marks)
                             + f" | {stock_tpot} | {', '.join(died) or '-'} |"))
    return "\n".join(head + [row for *_, row in sorted(body)]) + "\n"


TRADE = ("fcfs", "lpm", "hrrn", "shortest-prefill-first", "shortest-prefill-first+mixed", "fair_sched",
         "fair_sched/mixed", "fair_sched/x0m", "fair_sched/x512m", "fair_sched/mp2")


def trade_table(folder: Path = RESULTS) -> str:
    """The GPU cells at several loads (issue 27's 0.6 / 0.85): every policy's mean TTFT and TPOT, each
    over fcfs's on the same seeds, `mean / TPOT`; a server that exited before the cell's end shows
    `exited`. Where the 1.3x TPOT bound and the best stock mean meet is where issue 27 asks to be."""
    names = [p.replace("shortest-prefill-first", "SPF") for p in TRADE]
    head = ["| trace | chunk | load | seeds | GPU | " + " | ".join(names) + " | file |", "|" + "---|" * (len(TRADE) + 6)]
    body = []
    for path in sorted(folder.glob("gpu_*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(d["settings"].get("load"), list):
            continue
        gpu = gpu_label(d)
        for key, cell in d["metrics"].items():
            trace, chunk, load = key.split("@")
            if "fcfs" not in cell:
                continue
            figs = []
            for p in TRADE:
                fig = cell.get(p)
                if p == "fcfs" and fig:
                    figs.append("1 / 1")
                elif p in cell.get("exited", []):
                    figs.append("exited")
                elif fig and "vs_fcfs" in fig:
                    figs.append(f"{fig['vs_fcfs']['ttft_s_mean']:.2f} / {fig['vs_fcfs']['tpot_s_mean']:.2f}")
                else:
                    figs.append("")
            body.append(f"| {trace} | {chunk} | {load} | {cell['fcfs']['seeds']} | {gpu} | " + " | ".join(figs)
                        + f" | {path.stem} |")
    return "\n".join(head + sorted(body)) + "\n"


def render(doc_text: str, folder: Path = RESULTS) -> str:
    """`doc_text` with its generated server-grid and gpu-grid blocks rewritten (one-line error without markers)."""
    cmd = "python benchmarks/fair_sched/server_table.py --write"
    text = replace_generated(doc_text, "server-grid", table(folder), cmd, "docs/fair_sched.md")
    text = replace_generated(text, "server-grid-pd", table(folder, pd=True), cmd, "docs/fair_sched.md")
    text = replace_generated(text, "gpu-grid", gpu_table(folder), cmd, "docs/fair_sched.md")
    text = replace_generated(text, "gpu-grid-pd", gpu_table(folder, PD_GPU), cmd, "docs/fair_sched.md")
    return replace_generated(text, "gpu-trade", trade_table(folder), cmd, "docs/fair_sched.md")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/fair_sched.md")
    a = ap.parse_args()
    if not a.write:
        sys.stdout.write(table() + "\n" + table(pd=True) + "\n" + gpu_table() + "\n" + gpu_table(pattern=PD_GPU) + "\n"
                         + trade_table())
        return 0
    rewrite_doc(DOC, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
