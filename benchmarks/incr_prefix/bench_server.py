"""Benchmark: the scheduler's gap between prefill chunks on a real SGLang server (CPU platform,
tiny model), stock vs incr_prefix, on both TreeCores, in one run.

One long prompt is prefilled in chunks on four servers, one after the other; every server runs
`--radix-cache-backend kllm_incremental` (stock modes switch the plugin's paths off with
`KLLM_INCR_PREFIX_ENABLED=0`, so every checkpoint is SGLang's own `checkpoint_into_tree`, timed
by the same counters) and the `trace` plugin, which times every `get_next_batch_to_run` call:
  rust-stock / rust-ours       SGLang's default Rust TreeCore
  python-stock / python-ours   the Python TreeCore (`force_python_treecore`)
Reported per mode: checkpoint time per chunk (the plugin's counters), the scheduler's batch
selection time per prefill pass (trace: the gap between two chunks, stashing the previous
chunk into the tree included), the request's latency, and (with --profile) the top functions
under `get_next_batch_to_run` by cumulative time. Output ids must be identical across modes.

    python benchmarks/incr_prefix/bench_server.py --prompt 32768 --chunk 512 --profile
The tiny model's native context is 8192 tokens; longer prompts run with --context-length and
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (RoPE extrapolates; outputs are compared only
across modes, all on the same weights).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import io
import json
import os
import pstats
import shlex
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

MODES = {
    "rust-stock": {"KLLM_INCR_PREFIX_ENABLED": "0"},
    "rust-ours": {"KLLM_INCR_PREFIX_ENABLED": "1"},
    "python-stock": {"KLLM_INCR_PREFIX_ENABLED": "0", "KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE": "1"},
    "python-ours": {"KLLM_INCR_PREFIX_ENABLED": "1", "KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE": "1"},
}


def _top_profile(prefix: str, n: int = 12) -> list[str]:
    files = glob.glob(prefix + ".*")
    if not files:
        return []
    st = pstats.Stats(files[0], stream=io.StringIO())
    for f in files[1:]:
        st.add(f)
    rows = []
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((ct, nc, tt, f"{os.path.basename(fn)}:{line}({name})"))
    rows.sort(reverse=True)
    return [f"{ct * 1e3:9.1f} ms cum {tt * 1e3:8.1f} ms self {nc:7d} calls  {where}" for ct, nc, tt, where in rows[:n]]


def run_mode(model: str, mode: str, prompt: list[int], chunk: int, profile: bool) -> dict[str, Any]:
    from kllm_plugins.testing.sglang_server import SGLangServer

    prof_prefix = os.path.join(tempfile.mkdtemp(prefix="kllm-incr-prof-"), "select") if profile else ""
    env = {
        "KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1",
        "KLLM_TRACE_PUBLISH_INTERVAL_S": "0.1",
        "KLLM_TRACE_PROFILE_PATH": prof_prefix,
    }
    env.update(MODES[mode])
    ctx = max(8192, len(prompt) + 64)
    args = ["--chunked-prefill-size", str(chunk), "--dtype", "float32", "--radix-cache-backend", "kllm_incremental"]
    if ctx > 8192:
        args += ["--context-length", str(ctx)]
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    with SGLangServer(
        model, plugins=["incr_prefix", "trace"], extra_args=args, env=env, max_total_tokens=len(prompt) + 2048
    ) as srv:
        srv.generate(input_ids=[5, 6, 7], max_new_tokens=1)  # warm-up
        time.sleep(0.3)
        before = srv.get_json("/kllm/stats")["trace"]["total"]
        t0 = time.perf_counter()
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
        out = srv.post_json("/generate", body, timeout=1800)
        latency = time.perf_counter() - t0
        time.sleep(2.5 if profile else 0.4)
        stats = srv.get_json("/kllm/stats")
    total = stats["incr_prefix"]["total"]
    after = stats["trace"]["total"]
    checkpoints = total["tail_inserts"] + total["full_walks"]
    seconds = total["tail_seconds"] + total["full_seconds"]
    prefill_passes = after["prefill_batches"] - before["prefill_batches"]
    gap = after["prefill_select_seconds"] - before["prefill_select_seconds"]
    return {
        "mode": mode,
        "latency_s": latency,
        "checkpoints": checkpoints,
        "checkpoint_total_s": seconds,
        "checkpoint_mean_ms": 1e3 * seconds / max(1, checkpoints),
        "prefill_passes": prefill_passes,
        "select_gap_total_s": gap,
        "select_gap_mean_ms": 1e3 * gap / max(1, prefill_passes),
        "tail_inserts": total["tail_inserts"],
        "full_walks": total["full_walks"],
        "profile_top": _top_profile(prof_prefix) if profile else [],
        "output_ids": out["output_ids"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--modes", default="rust-stock,rust-ours,python-stock,python-ours")
    ap.add_argument("--profile", action="store_true", help="cProfile get_next_batch_to_run in each server")
    ap.add_argument("--results-md", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "incr_prefix_server.json"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    prompt = [(i * 37) % 3000 + 10 for i in range(args.prompt)]
    rows = [run_mode(model, m, prompt, args.chunk, args.profile) for m in args.modes.split(",")]
    print(
        f"{'mode':13} | {'chunks':>6} {'tree ms/chunk':>13} {'tree total s':>12} | "
        f"{'gap ms/chunk':>12} {'gap total s':>11} | {'latency s':>9} | tail/full"
    )
    for r in rows:
        print(
            f"{r['mode']:13} | {r['checkpoints']:6d} {r['checkpoint_mean_ms']:13.3f} {r['checkpoint_total_s']:12.4f} | "
            f"{r['select_gap_mean_ms']:12.3f} {r['select_gap_total_s']:11.4f} | "
            f"{r['latency_s']:9.2f} | {r['tail_inserts']}/{r['full_walks']}"
        )
    by = {r["mode"]: r for r in rows}
    ratios = {}
    for core in ("rust", "python"):
        st, ou = by.get(f"{core}-stock"), by.get(f"{core}-ours")
        if st and ou:
            ratios[core] = {
                "tree": st["checkpoint_total_s"] / max(ou["checkpoint_total_s"], 1e-9),
                "gap": st["select_gap_total_s"] / max(ou["select_gap_total_s"], 1e-9),
                "latency": st["latency_s"] / max(ou["latency_s"], 1e-9),
            }
            print(f"{core}: stock/ours tree {ratios[core]['tree']:.1f}x, gap {ratios[core]['gap']:.2f}x, latency {ratios[core]['latency']:.3f}x")
    for r in rows:
        if r["profile_top"]:
            print(f"\n{r['mode']}: get_next_batch_to_run profile (top by cumulative time)")
            for line in r["profile_top"]:
                print("  " + line)
    same = len({tuple(r["output_ids"]) for r in rows}) == 1
    print(f"outputs identical across modes: {same}")
    if args.no_record:
        return
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(
            {"command": command, "prompt_tokens": args.prompt, "chunk_tokens": args.chunk, "ratios_stock_over_ours": ratios, "rows": rows},
            fh, indent=1,
        )
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## incr_prefix: scheduler gap between chunks on a real CPU server ({day})\n",
        f"Command: `{command}`  \nTiny Llama on the kllm CPU platform; {args.prompt}-token prompt, "
        f"`--chunked-prefill-size {args.chunk}`; tree time from the plugin's counters; gap = `get_next_batch_to_run` "
        f"time of prefill passes (trace plugin); outputs identical: {same}.\n\n",
        "| mode | checkpoints | tree ms/chunk | tree total s | gap ms/chunk | gap total s | request latency s |\n|---|---|---|---|---|---|---|\n",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['checkpoints']} | {r['checkpoint_mean_ms']:.3f} | {r['checkpoint_total_s']:.4f} | "
            f"{r['select_gap_mean_ms']:.3f} | {r['select_gap_total_s']:.4f} | {r['latency_s']:.2f} |\n"
        )
    for core, rt in ratios.items():
        lines.append(f"\n{core}: stock/ours tree {rt['tree']:.1f}x, gap {rt['gap']:.2f}x, latency {rt['latency']:.3f}x\n")
    for r in rows:
        if r["profile_top"]:
            lines.append(f"\n{r['mode']} profile of `get_next_batch_to_run` (top by cumulative time):\n\n```\n")
            lines.extend(line + "\n" for line in r["profile_top"])
            lines.append("```\n")
    with open(args.results_md, "a", encoding="utf-8") as fh:
        fh.writelines(lines)


if __name__ == "__main__":
    main()
