"""Benchmark: radix-tree time of chunked prefill, stock UnifiedRadixCache vs incr_prefix.

Runs on SGLang's real classes on CPU (no model): a long prompt is prefilled in chunks and each
chunk is checkpointed exactly as the scheduler does between chunks
(`checkpoint_kv_cache` -> `UnifiedRadixCache.checkpoint` -> `checkpoint_into_tree`), then the
request is finished (`release_kv_cache(checkpoint=True)`). Only those tree calls are timed.
Stock and incremental caches run alternately in the same process, per point and repeat.

Scenarios: `alone` (one request) and `shared` (a second request sharing the first half of the
prompt is prefilled in interleaved chunks, splitting the first one's nodes). A `short` scenario
measures the overhead on short single-chunk prompts (target: no more than 3% slower).

    python benchmarks/incr_prefix/bench_tree.py                       # default grid
    python benchmarks/incr_prefix/bench_tree.py --quick               # small smoke grid
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
from typing import Any

from kllm_plugins.bench.plot import figure
from kllm_plugins.bench.progress import Progress

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _sizes(text: str) -> list[int]:
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        if x.endswith("k"):
            out.append(int(x[:-1]) * 1024)
        elif x.endswith("m"):
            out.append(int(x[:-1]) * 1024 * 1024)
        else:
            out.append(int(x))
    return out


def _run_long(core: str, page: int, prompt: int, chunk: int, incremental: bool, shared: bool) -> dict[str, Any]:
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import build_cpu_cache
    from kllm_plugins.plugins.incr_prefix.sglang_testing import CacheDriver

    extra = prompt // 2 + chunk if shared else 0
    cache, alloc, pool = build_cpu_cache(
        page_size=page,
        kv_size=prompt + extra + 4 * chunk,
        max_context_len=prompt + 64,
        max_num_reqs=4,
        tree_core=core,
        incremental=incremental,
    )
    drv = CacheDriver(cache, alloc, pool)
    tokens = list(range(1, prompt + 1))
    runs = [drv.admit("long", tokens)]
    if shared:
        half = prompt // 2
        runs.append(drv.admit("other", tokens[:half] + [prompt + 7 + i for i in range(half)]))
    per_chunk: list[float] = []
    total = 0.0
    live = list(runs)
    gc.disable()
    try:
        while live:
            for run in list(live):
                ok = drv.extend(run, chunk)
                assert ok, "KV pool too small"
                dt = drv.last_tree_s
                total += dt
                if run is runs[0]:
                    per_chunk.append(dt)
                if run.done >= len(run.req.origin_input_ids):
                    live.remove(run)
        release = 0.0
        for run in runs:
            drv.decode(run, 5)
            drv.finish(run)
            release += drv.last_tree_s
    finally:
        gc.enable()
    counters = getattr(cache, "kllm_counters", None)
    return {
        "total": total + release,
        "chunks_total": total,
        "release": release,
        "per_chunk": per_chunk,
        "counters": counters.snapshot() if counters is not None else None,
    }


def _run_short(core: str, page: int, prompt: int, n: int) -> tuple[float, float]:
    """Median per-request tree time (chunk checkpoint + finishing release) for short prompts,
    stock and ours. Both caches live side by side and take turns request by request (order
    alternating), so load drift on a shared machine hits both equally."""
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import build_cpu_cache
    from kllm_plugins.plugins.incr_prefix.sglang_testing import CacheDriver

    drivers = []
    for inc in (False, True):
        cache, alloc, pool = build_cpu_cache(
            page_size=page, kv_size=(prompt + 8) * 64, max_context_len=prompt + 64, max_num_reqs=8,
            tree_core=core, incremental=inc,
        )
        drivers.append(CacheDriver(cache, alloc, pool))
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        tokens = [(i * 131 + j * 7) % 3000 + 1 for j in range(prompt)]
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            drv = drivers[k]
            run = drv.admit(f"s{i}", tokens)
            drv.extend(run, prompt)
            tree = drv.last_tree_s
            drv.decode(run, 5)
            drv.finish(run)
            times[k].append(tree + drv.last_tree_s)
    return statistics.median(times[0]), statistics.median(times[1])



def _spread(xs: list[float]) -> str:
    return f"{min(xs):.4f}-{max(xs):.4f}" if len(xs) > 1 else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--treecores", default="python,rust")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--prompts", default="32k,128k,512k,1m")
    ap.add_argument("--chunks", default="2k,8k,16k")
    ap.add_argument("--scenarios", default="alone,shared", help="alone, shared")
    ap.add_argument("--shared-prompts", default="128k,512k", help="prompt sizes for the shared scenario")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-stock-s", type=float, default=8.0, help="no repeat of a point whose stock run took longer")
    ap.add_argument("--short-prompts", default="256,1024,4096")
    ap.add_argument("--short-n", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="small grid for a smoke run")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "incr_prefix.json"))
    ap.add_argument("--results-md", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    ap.add_argument("--no-record", action="store_true", help="print only; write neither JSON nor RESULTS.md")
    ap.add_argument("--plot", default="", help="write a PNG of per-chunk time (needs matplotlib)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.chunks, args.page_sizes, args.repeats = "32k,128k", "8k", "1,16", 2
        args.shared_prompts, args.short_n, args.short_prompts = "128k", 100, "1024"
    logging.basicConfig(level=logging.WARNING)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])

    import torch

    torch.set_num_threads(1)
    cores = args.treecores.split(",")
    pages = [int(x) for x in args.page_sizes.split(",")]
    prompts, chunks = _sizes(args.prompts), _sizes(args.chunks)
    scen = args.scenarios.split(",")
    grid = []
    for core in cores:
        for page in pages:
            for scenario in scen:
                sizes = prompts if scenario == "alone" else [p for p in _sizes(args.shared_prompts)]
                for prompt in sizes:
                    for chunk in (chunks if scenario == "alone" else [8 * 1024]):
                        if chunk < prompt:
                            grid.append((core, page, scenario, prompt, chunk))
    points: list[dict[str, Any]] = []
    bar = Progress(len(grid), "tree grid")
    for core, page, scenario, prompt, chunk in grid:
        stock_runs: list[dict[str, Any]] = []
        ours_runs: list[dict[str, Any]] = []
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for inc in order:
                res = _run_long(core, page, prompt, chunk, inc, scenario == "shared")
                (ours_runs if inc else stock_runs).append(res)
            if stock_runs[-1]["total"] > args.max_stock_s:
                break
        st = [x["total"] for x in stock_runs]
        ou = [x["total"] for x in ours_runs]
        ms, mo = statistics.median(st), statistics.median(ou)
        pc_s = stock_runs[0]["per_chunk"]
        pc_o = ours_runs[0]["per_chunk"]
        q = max(1, len(pc_o) // 4)
        points.append(
            {
                "treecore": core,
                "page_size": page,
                "scenario": scenario,
                "prompt_tokens": prompt,
                "chunk_tokens": chunk,
                "repeats": len(st),
                "stock_total_s": ms,
                "ours_total_s": mo,
                "ratio": ms / mo if mo > 0 else None,
                "stock_total_spread_s": [min(st), max(st)],
                "ours_total_spread_s": [min(ou), max(ou)],
                "stock_release_s": statistics.median(x["release"] for x in stock_runs),
                "ours_release_s": statistics.median(x["release"] for x in ours_runs),
                "stock_chunk_first_quarter_median_s": statistics.median(pc_s[:q]),
                "stock_chunk_last_quarter_median_s": statistics.median(pc_s[-q:]),
                "ours_chunk_first_quarter_median_s": statistics.median(pc_o[:q]),
                "ours_chunk_last_quarter_median_s": statistics.median(pc_o[-q:]),
                "stock_last_chunk_s": pc_s[-1],
                "ours_last_chunk_s": pc_o[-1],
                "ours_counters": ours_runs[0]["counters"],
            }
        )
        bar.step()
    # The serving default is Rust, which the tail path cannot drive: also compare Rust stock
    # with the Python TreeCore + tail inserts (the force_python_treecore option).
    rust = {(p["page_size"], p["scenario"], p["prompt_tokens"], p["chunk_tokens"]): p for p in points if p["treecore"] == "rust"}
    for p in points:
        r = rust.get((p["page_size"], p["scenario"], p["prompt_tokens"], p["chunk_tokens"]))
        if p["treecore"] == "python" and r is not None and p["ours_total_s"] > 0:
            p["rust_stock_over_python_ours"] = r["stock_total_s"] / p["ours_total_s"]

    short_points = []
    for core in cores:
        for prompt in (_sizes(args.short_prompts) if args.short_n > 0 and args.short_prompts else []):
            s_vals, o_vals = [], []
            for r in range(max(5, args.repeats)):
                ms_r, mo_r = _run_short(core, 1, prompt, args.short_n)
                s_vals.append(ms_r)
                o_vals.append(mo_r)
            ms, mo = statistics.median(s_vals), statistics.median(o_vals)
            short_points.append(
                {"treecore": core, "page_size": 1, "prompt_tokens": prompt, "requests": args.short_n,
                 "stock_per_req_s": ms, "ours_per_req_s": mo, "ours_slower_pct": 100.0 * (mo / ms - 1.0)}
            )

    hdr = f"{'core':6} {'pg':>3} {'scen':6} {'prompt':>8} {'chunk':>6} | {'stock s':>8} {'ours s':>8} {'ratio':>7} | {'stock last-q/chunk':>18} {'ours first-q':>12} {'ours last-q':>11} | tail/full"
    print(hdr)
    print("-" * len(hdr))
    for p in points:
        c = p["ours_counters"] or {}
        print(
            f"{p['treecore']:6} {p['page_size']:>3} {p['scenario']:6} {p['prompt_tokens']:>8} {p['chunk_tokens']:>6} | "
            f"{p['stock_total_s']:8.4f} {p['ours_total_s']:8.4f} {p['ratio']:7.1f} | "
            f"{p['stock_chunk_last_quarter_median_s'] * 1e3:15.2f} ms {p['ours_chunk_first_quarter_median_s'] * 1e3:9.3f} ms "
            f"{p['ours_chunk_last_quarter_median_s'] * 1e3:8.3f} ms | {c.get('tail_inserts', 0)}/{c.get('full_walks', 0)}"
            + (f" | rust-stock/py-ours {p['rust_stock_over_python_ours']:.1f}x" if "rust_stock_over_python_ours" in p else "")
        )
    print()
    print(f"{'core':6} {'prompt':>7} | {'stock us/req':>12} {'ours us/req':>12} {'ours slower':>11}")
    for s in short_points:
        print(f"{s['treecore']:6} {s['prompt_tokens']:>7} | {s['stock_per_req_s'] * 1e6:12.1f} {s['ours_per_req_s'] * 1e6:12.1f} {s['ours_slower_pct']:10.1f}%")

    if args.no_record:
        return
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    doc = {
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs (shared); torch {torch.__version__}",
        "points": points,
        "short": short_points,
    }
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    _append_results(args.results_md, command, points, short_points)
    if args.plot:
        _plot(args.plot, points)


def _append_results(path: str, command: str, points: list[dict[str, Any]], short: list[dict[str, Any]]) -> None:
    new = not os.path.exists(path)
    lines = []
    if new:
        lines.append("# Benchmark results\n")
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"\n## incr_prefix: radix-tree time of chunked prefill, stock vs tail-only inserts ({day})\n")
    lines.append(f"Command: `{command}`  \nReal SGLang 0.5.23 `UnifiedRadixCache` on CPU (2 shared cores); total = every chunk checkpoint + final release; medians of alternating runs.\n\n")
    lines.append("| TreeCore | page | scenario | prompt | chunk | stock total s | ours total s | ratio | stock last-quarter chunk ms | ours last-quarter chunk ms | Rust stock / Python ours |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    for p in points:
        lines.append(
            f"| {p['treecore']} | {p['page_size']} | {p['scenario']} | {p['prompt_tokens'] // 1024}K | {p['chunk_tokens'] // 1024}K | "
            f"{p['stock_total_s']:.4f} | {p['ours_total_s']:.4f} | {p['ratio']:.1f}x | "
            f"{p['stock_chunk_last_quarter_median_s'] * 1e3:.2f} | {p['ours_chunk_last_quarter_median_s'] * 1e3:.3f} | "
            + (f"{p['rust_stock_over_python_ours']:.1f}x |\n" if "rust_stock_over_python_ours" in p else "- |\n")
        )
    if short:
        lines.append("\nShort prompts (one chunk; checkpoint + finishing release per request):\n\n| TreeCore | prompt | stock us/req | ours us/req | ours slower |\n|---|---|---|---|---|\n")
        for s in short:
            lines.append(f"| {s['treecore']} | {s['prompt_tokens']} | {s['stock_per_req_s'] * 1e6:.1f} | {s['ours_per_req_s'] * 1e6:.1f} | {s['ours_slower_pct']:+.1f}% |\n")
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(lines)


def _plot(path: str, points: list[dict[str, Any]]) -> None:
    with figure(path, dpi=120) as axes:
        if axes is not None:
            _draw(axes[0][0], points)


def _draw(ax: Any, points: list[dict[str, Any]]) -> None:
    for p in points:
        if p["scenario"] != "alone" or p["chunk_tokens"] != 8 * 1024:
            continue
        label = f"{p['treecore']} pg{p['page_size']}"
        ax.scatter(p["prompt_tokens"], p["stock_total_s"], marker="o", label=f"stock {label}")
        ax.scatter(p["prompt_tokens"], p["ours_total_s"], marker="x", label=f"ours {label}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (8K chunks)")
    ax.set_ylabel("total tree time, s")
    ax.legend(fontsize=6)


if __name__ == "__main__":
    main()
