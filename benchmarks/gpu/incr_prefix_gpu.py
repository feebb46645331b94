"""GPU row of incr_prefix: one long prompt prefilled in 8192-token chunks on SGLang (kllm_cuda,
8B-shaped random bf16 model), stock checkpointing vs the plugin's tail inserts, on the Python
TreeCore (the Rust one does not load under the lent machine's torch; kllm_cuda picks Python).

Two servers up at once, both `--radix-cache-backend kllm_incremental` with the `trace` plugin
(stock: `KLLM_INCR_PREFIX_ENABLED=0`, so every checkpoint is SGLang's own, timed by the same
counters). Requests go one at a time, modes interleaved (ABBA across lengths and repeats), each a
fresh prompt (no prefix hit). Per request: the scheduler's batch-selection time per prefill pass
(trace: the gap between chunks, checkpointing the previous chunk included), the checkpoint time
per chunk (the plugin's counters) and the prefill latency (1 output token).

    python benchmarks/gpu/incr_prefix_gpu.py --lengths 32768 65536 131072 --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench_common import Setup, header, log, spread, write  # noqa: E402

MODES = {"python-stock": {"KLLM_INCR_PREFIX_ENABLED": "0"}, "python-ours": {"KLLM_INCR_PREFIX_ENABLED": "1"}}


def one(srv: Any, prompt: list[int]) -> dict[str, float]:
    def snap() -> dict[str, Any]:
        time.sleep(0.35)
        return srv.get_json("/kllm/stats")

    before = snap()
    t0 = time.perf_counter()
    srv.post_json("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                                          "ignore_eos": True}}, timeout=900)
    latency = time.perf_counter() - t0
    after = snap()
    tb, ta = before["trace"]["total"], after["trace"]["total"]
    ib, ia = before["incr_prefix"]["total"], after["incr_prefix"]["total"]
    passes = ta["prefill_batches"] - tb["prefill_batches"]
    gap = ta["prefill_select_seconds"] - tb["prefill_select_seconds"]
    cks = (ia["tail_inserts"] + ia["full_walks"]) - (ib["tail_inserts"] + ib["full_walks"])
    ck_s = (ia["tail_seconds"] + ia["full_seconds"]) - (ib["tail_seconds"] + ib["full_seconds"])
    return {"latency_s": latency, "prefill_passes": passes, "gap_total_s": gap, "gap_ms_per_pass": 1e3 * gap / max(1, passes),
            "checkpoints": cks, "checkpoint_ms_per_chunk": 1e3 * ck_s / max(1, cks), "checkpoint_total_s": ck_s,
            "tail_inserts": ia["tail_inserts"] - ib["tail_inserts"], "full_walks": ia["full_walks"] - ib["full_walks"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--layers", type=int, default=0, help="layers of the random model (0: the 8B shape's 32); the "
                    "gap between chunks is the scheduler's, so fewer layers reach 1M tokens within a device call")
    ap.add_argument("--heads", type=int, default=0, help="attention heads (0: the 8B shape's 32); KV heads follow "
                    "when fewer than its 8")
    ap.add_argument("--single-repeat-from", type=int, default=131072,
                    help="lengths from this one run once per mode")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    longest = max(a.lengths)
    shape = {k: v for k, v in (("num_hidden_layers", a.layers), ("num_attention_heads", a.heads),
                               ("num_key_value_heads", min(8, a.heads) if a.heads else 0)) if v}
    setup = Setup(a.cpu_dry_run, max_positions=max(8192, 1 << (longest + 1024).bit_length()), **shape)
    res = header("benchmarks/gpu/incr_prefix_gpu.py", "python " + " ".join(sys.argv), setup,
                 {"lengths": a.lengths, "repeats": a.repeats, "chunk": a.chunk, "treecore": "python", "shape": shape,
                  "single_repeat_from": a.single_repeat_from,
                  "modes": list(MODES), "output_tokens": 1})
    extra = ["--chunked-prefill-size", str(a.chunk), "--radix-cache-backend", "kllm_incremental"]
    env = {"KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1", "KLLM_TRACE_PUBLISH_INTERVAL_S": "0.1",
           "KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE": "1"}
    if setup.cpu:
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        extra += ["--context-length", str(longest + 1024)]
    from kllm_plugins.testing.sglang_server import start_all

    # the stock mode's incr_prefix is inert by design (its counters still time SGLang's own checkpoints):
    # strict mode would refuse it, so it starts non-strict
    servers = {m: setup.server(["incr_prefix", "trace"], extra, {**env, **menv}, longest + 4096, a.mem_fraction,
                               graphs=False, strict=m != "python-stock") for m, menv in MODES.items()}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        start_all(list(servers.values()))
        log("incr", f"servers up in {time.perf_counter() - t0:.0f} s")
        for srv in servers.values():  # warm-up: Triton kernels at every chunk shape
            srv.generate(input_ids=list(range(100, 100 + min(2 * a.chunk + 100, longest))), max_new_tokens=1)
        k = 0
        for length in a.lengths:
            for rep in range(a.repeats if length < a.single_repeat_from or setup.cpu else 1):
                order = list(MODES) if k % 2 == 0 else list(MODES)[::-1]
                k += 1
                for mode in order:
                    rng = random.Random(f"{length}/{rep}/{mode}")
                    prompt = [rng.randrange(10, setup.vocab - 10) for _ in range(length)]
                    row = {"mode": mode, "length": length, "repeat": rep, **one(servers[mode], prompt)}
                    rows.append(row)
                    log("incr", f"{mode} {length}: latency {row['latency_s']:.2f} s, gap {row['gap_ms_per_pass']:.2f} "
                        f"ms/pass over {row['prefill_passes']}, checkpoint {row['checkpoint_ms_per_chunk']:.2f} ms/chunk "
                        f"({row['tail_inserts']} tail / {row['full_walks']} full)")
                    res["rows"] = rows
                    write(a.out, res)
        res["treecore_log"] = {m: s.grep_log(r"TreeCore \w+")[:1] for m, s in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
    metrics: dict[str, Any] = {}
    for length in a.lengths:
        per = {m: [r for r in rows if r["length"] == length and r["mode"] == m] for m in MODES}
        if not all(per.values()):
            continue
        cell = {m: {key: spread([r[key] for r in rs]) for key in ("latency_s", "gap_ms_per_pass", "gap_total_s",
                                                                 "checkpoint_ms_per_chunk")} for m, rs in per.items()}
        st, ou = cell["python-stock"], cell["python-ours"]
        cell["stock_over_ours"] = {key: st[key]["median"] / max(ou[key]["median"], 1e-9)
                                   for key in ("latency_s", "gap_ms_per_pass", "checkpoint_ms_per_chunk")}
        metrics[str(length)] = cell
    res["metrics"] = metrics
    write(a.out, res)
    for length, cell in metrics.items():
        r = cell["stock_over_ours"]
        log("incr", f"{length}: gap/pass stock {cell['python-stock']['gap_ms_per_pass']['median']:.2f} ms vs ours "
            f"{cell['python-ours']['gap_ms_per_pass']['median']:.2f} ms; prefill {cell['python-stock']['latency_s']['median']:.2f}"
            f" vs {cell['python-ours']['latency_s']['median']:.2f} s; stock/ours latency {r['latency_s']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
