"""Benchmark: tree time between prefill chunks on a real SGLang server (CPU platform, tiny model).

One long prompt is prefilled in small chunks on three servers, one after the other:
  rust-stock    `--radix-cache-backend kllm_incremental` on SGLang's default Rust TreeCore: the
                plugin cannot drive it, so every checkpoint is SGLang's own (timed by the plugin);
  python-stock  the same on the Python TreeCore with `KLLM_INCR_PREFIX_ENABLED=0`: every
                checkpoint is SGLang's `checkpoint_into_tree`, timed;
  python-ours   the Python TreeCore with tail-only inserts.
Reports the checkpoint time per chunk (the part of the scheduler's between-chunk work this plugin
changes, read from the plugin's counters at /kllm/stats) and the request's end-to-end latency.

    python benchmarks/incr_prefix/bench_server.py --prompt 4000 --chunk 64
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

MODES = {
    "rust-stock": {"KLLM_INCR_PREFIX_ENABLED": "1"},
    "python-stock": {"KLLM_INCR_PREFIX_ENABLED": "0", "KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE": "1"},
    "python-ours": {"KLLM_INCR_PREFIX_ENABLED": "1", "KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE": "1"},
}


def run_mode(model: str, mode: str, prompt: list[int], chunk: int) -> dict[str, Any]:
    from kllm_plugins.testing.sglang_server import SGLangServer

    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.incr_prefix.hookimpls", "KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1"}
    env.update(MODES[mode])
    args = ["--chunked-prefill-size", str(chunk), "--dtype", "float32", "--radix-cache-backend", "kllm_incremental"]
    with SGLangServer(model, plugins=["incr_prefix"], extra_args=args, env=env, max_total_tokens=len(prompt) + 2048) as srv:
        srv.generate(input_ids=[5, 6, 7], max_new_tokens=1)  # warm-up
        t0 = time.perf_counter()
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
        out = srv.post_json("/generate", body, timeout=900)
        latency = time.perf_counter() - t0
        time.sleep(0.4)
        total = srv.get_json("/kllm/stats")["incr_prefix"]["total"]
    checkpoints = total["tail_inserts"] + total["full_walks"]
    seconds = total["tail_seconds"] + total["full_seconds"]
    return {
        "mode": mode,
        "latency_s": latency,
        "checkpoints": checkpoints,
        "checkpoint_total_s": seconds,
        "checkpoint_mean_ms": 1e3 * seconds / max(1, checkpoints),
        "tail_inserts": total["tail_inserts"],
        "full_walks": total["full_walks"],
        "output_ids": out["output_ids"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=4000, help="tokens (the tiny model has an 8192-token context)")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--modes", default="rust-stock,python-stock,python-ours")
    ap.add_argument("--results-md", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "incr_prefix_server.json"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    model = str(tiny_llama_path())
    prompt = [(i * 37) % 3000 + 10 for i in range(args.prompt)]
    rows = [run_mode(model, m, prompt, args.chunk) for m in args.modes.split(",")]
    print(f"{'mode':13} | {'chunks':>6} {'tree ms/chunk':>13} {'tree total s':>12} | {'latency s':>9} | tail/full")
    for r in rows:
        print(
            f"{r['mode']:13} | {r['checkpoints']:6d} {r['checkpoint_mean_ms']:13.3f} {r['checkpoint_total_s']:12.4f} | "
            f"{r['latency_s']:9.2f} | {r['tail_inserts']}/{r['full_walks']}"
        )
    same = len({tuple(r["output_ids"]) for r in rows}) == 1
    print(f"outputs identical across modes: {same}")
    if args.no_record:
        return
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"command": command, "prompt_tokens": args.prompt, "chunk_tokens": args.chunk, "rows": rows}, fh, indent=1)
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## incr_prefix: checkpoint time between chunks on a real CPU server ({day})\n",
        f"Command: `{command}`  \nTiny Llama on the kllm CPU platform; {args.prompt}-token prompt, "
        f"`--chunked-prefill-size {args.chunk}`; tree time from the plugin's counters; outputs identical: {same}.\n\n",
        "| mode | checkpoints | tree ms/chunk | tree total s | request latency s |\n|---|---|---|---|---|\n",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['checkpoints']} | {r['checkpoint_mean_ms']:.3f} | {r['checkpoint_total_s']:.4f} | {r['latency_s']:.2f} |\n"
        )
    with open(args.results_md, "a", encoding="utf-8") as fh:
        fh.writelines(lines)


if __name__ == "__main__":
    main()
