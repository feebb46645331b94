"""How slow must an L3 medium be to lose against recomputing? (not collected by pytest)

Starts one L1-only SGLang server on CPU (tiny Llama, the flags of bench_tiers.py) and measures, at
the lengths of the traces:
- TTFT of prompts sharing nothing (cold: the whole prompt is prefilled), several per length, and its
  affine fit `a + b * tokens` (b: seconds per recomputed token);
- TTFT of the same prompt sent again (its prefix is an L1 hit), so cold - hot is what a hit of that
  length saves, measured directly;
- KV bytes per token (layers x 2 x KV heads x head dim x dtype bytes, from the model config).
From them: the L3 read bandwidth at which loading a hit costs as much as recomputing it
(`bytes_per_token / b`), and per 16-token page the recompute time that a page read plus an
existence check must beat.

    python benchmarks/kv_tiers/calib_medium.py --lengths 64,128,256,384,512,768 --reps 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.sglang_server import SGLangServer

sys.path.insert(0, str(Path(__file__).parent))
from replay import stream_generate  # noqa: E402
from trace_gen import tokens_for  # noqa: E402


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.get("dtype") or cfg.get("torch_dtype", "bfloat16")]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,128,256,384,512,768")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = tiny_llama_path()
    bpt = kv_bytes_per_token(model)
    server = SGLangServer(model, extra_args=["--page-size", "16", "--chunked-prefill-size", "512"],
                          max_total_tokens=max(4096, 4 * max(lengths)), startup_timeout_s=400)
    rows = []
    next_block = 1 << 28
    with server:
        for _ in range(4):  # warm-up
            stream_generate(server.base_url, tokens_for(list(range(next_block, next_block + 8))), 1)
            next_block += 8
        for n in lengths:
            cold, hot = [], []
            for _ in range(args.reps):
                ids = tokens_for(list(range(next_block, next_block + n // 16)))
                next_block += n // 16
                cold.append(stream_generate(server.base_url, ids, 1)[0])
                hot.append(stream_generate(server.base_url, ids, 1)[0])
            rows.append({"tokens": n, "cold_ttft_s": statistics.median(cold), "hot_ttft_s": statistics.median(hot),
                         "cold_all": cold, "hot_all": hot})
            print(f"{n:5d} tokens: cold TTFT {statistics.median(cold) * 1e3:7.1f} ms, L1 hit "
                  f"{statistics.median(hot) * 1e3:6.1f} ms, saved {(statistics.median(cold) - statistics.median(hot)) * 1e3:6.1f} ms",
                  flush=True)
    a, b = fit([r["tokens"] for r in rows], [r["cold_ttft_s"] for r in rows])
    saved_per_tok = statistics.median((r["cold_ttft_s"] - r["hot_ttft_s"]) / r["tokens"] for r in rows)
    per_tok = max(b, saved_per_tok)
    out = {"kv_bytes_per_token": bpt, "cold_ttft_fit": {"fixed_s": a, "per_token_s": b},
           "saved_per_hit_token_s_median": saved_per_tok, "prefill_tokens_per_s_marginal": 1 / b,
           "break_even_read_mb_s_fit": bpt / b / 1e6, "break_even_read_mb_s_saved": bpt / saved_per_tok / 1e6,
           "recompute_ms_per_16_token_page": 16 * per_tok * 1e3, "rows": rows}
    print(f"KV {bpt} B/token; cold TTFT = {a * 1e3:.1f} ms + {b * 1e6:.1f} us/token ({1 / b:.0f} tokens/s "
          f"marginal); an L1 hit saves {saved_per_tok * 1e6:.1f} us/token (median over lengths)")
    print(f"loading equals recomputing at {bpt / b / 1e6:.2f} MB/s (fit) / {bpt / saved_per_tok / 1e6:.2f} MB/s "
          f"(saved) with no latency; a 16-token page recomputes in {16 * per_tok * 1e3:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
