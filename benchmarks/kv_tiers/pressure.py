"""Selective persistence under L3 pressure (part of bench_tiers.py --pressure; not collected by pytest).

Two servers share a kv_tiers file store whose capacity per instance (`--pressure-capacity-mb`) is
well below what the trace offers to L3. The trace interleaves multi-turn conversations (their
pages come back) with one-off prompts (theirs never do), one to one. Variants, same sizes:
- `write_all`: every page written (`min_reuse` 1, fill/busy bars at 1.0: no selection), LRU
  eviction makes room, as stock write-through with a bounded store would;
- `selective`: the plugin's defaults (write-all while the store has room; at `fill_high`, a page
  needs `min_reuse` sightings, a continuation its first).
Per variant and repeat (lifetimes A, B B, A): L3 hit tokens and hit rates (from SGLang's
per-request breakdown), bytes written to L3 (store counters of both instances, deltas over the
cell), L3 hit tokens per MiB written, TTFT, with one request in flight per server.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats, l3_args
from kllm_plugins.testing.sglang_server import SGLangServer, start_all
from replay import assign, measure, replay_serial
from trace_gen import generate

VARIANTS = {
    "write_all": {"KLLM_KV_TIERS_MIN_REUSE": "1", "KLLM_KV_TIERS_WRITE_ALL_BELOW_PRESSURE": "false",
                  "KLLM_KV_TIERS_FILL_HIGH": "1.0", "KLLM_KV_TIERS_BUSY_HIGH": "1.0"},
    "selective": {},
}
SPACE = 1 << 24


def mixed_trace(sessions: int, turns: int) -> list[dict[str, Any]]:
    """Conversations and one-off prompts of the same lengths, interleaved one to one."""
    conv = list(generate(sessions, turns))
    once = [dict(r, hash_ids=[h + (1 << 22) for h in r["hash_ids"]]) for r in generate(sessions, turns, unique=True)]
    return [r for pair in zip(conv, once) for r in pair]


def _written(servers: list[SGLangServer]) -> int:
    return sum(int(kv_tiers_stats(s).get("store", {}).get("put_bytes") or 0) for s in servers)


def run_pressure(args: argparse.Namespace) -> dict[str, Any]:
    trace = mixed_trace(args.sessions, args.turns)
    picks = assign(len(trace), 2, args.seed)
    cap_gb = args.pressure_capacity_mb / 1024.0
    common = ["--page-size", "16", "--chunked-prefill-size", "512"]
    cells: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    plan = [("write_all", [0]), ("selective", [0, 1]), ("write_all", [1])]
    for variant, reps in plan:
        store = tempfile.mkdtemp(prefix=f"kvt-pressure-{variant}-")
        env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls", "KLLM_KV_TIERS_STORE_DIR": store,
               "KLLM_KV_TIERS_STORE_CAPACITY_GB": f"{cap_gb:.9f}", **VARIANTS[variant]}
        servers = [SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=common + l3_args("kllm_file"),
                                env={**env, "KLLM_KV_TIERS_INSTANCE_ID": f"{variant}-{i}"},
                                max_total_tokens=args.l1_tokens, startup_timeout_s=400) for i in range(2)]
        urls = [s.base_url for s in servers]
        try:
            start_all(servers)
            warm = trace[: args.warmup]
            replay_serial(urls, warm, assign(len(warm), 2, args.seed), 0)
            for rep in reps:
                for s in servers:
                    flush(s.base_url)
                time.sleep(max(1.0, args.settle_s))
                w0 = _written(servers)
                res, makespan = replay_serial(urls, trace, picks, (1 + rep) * SPACE)
                time.sleep(1.0)  # stats snapshots are written every 0.5 s
                m = measure(res, makespan, args.slo_pct)
                m["written_bytes"] = _written(servers) - w0
                m["l3_hit_tokens_per_mib_written"] = m["l3_hit_tokens"] / max(1e-9, m["written_bytes"] / (1 << 20))
                cells[variant].append(m)
                print(f"  pressure {variant} rep {rep}: hit {m['hit_rate']['total']:.3f} (l3 {m['hit_rate']['l3']:.3f}, "
                      f"{m['l3_hit_tokens']} tokens), written {m['written_bytes'] / (1 << 20):.1f} MiB, "
                      f"{m['l3_hit_tokens_per_mib_written']:.0f} L3 hit tokens/MiB, TTFT mean {m['ttft_s']['mean']:.3f}",
                      file=sys.stderr, flush=True)
        finally:
            for s in servers:
                s.stop()
            shutil.rmtree(store, ignore_errors=True)
    out: dict[str, Any] = {"trace": f"mixed: synthetic sessions={args.sessions} turns={args.turns} + as many one-off "
                                    f"prompts, interleaved", "requests": len(trace),
                           "l3_capacity_mib_per_instance": args.pressure_capacity_mb, "variants": {}}
    for v, ms in cells.items():
        med = lambda f: statistics.median(f(m) for m in ms)  # noqa: E731
        out["variants"][v] = {
            "repeats": len(ms),
            "hit_rate": {k: med(lambda m, k=k: m["hit_rate"][k]) for k in ("l1", "l2", "l3", "total")},
            "l3_hit_tokens": med(lambda m: m["l3_hit_tokens"]),
            "written_mib": med(lambda m: m["written_bytes"] / (1 << 20)),
            "l3_hit_tokens_per_mib_written": med(lambda m: m["l3_hit_tokens_per_mib_written"]),
            "ttft_s": {k: med(lambda m, k=k: m["ttft_s"][k]) for k in ("mean", "p50", "p99")},
            "per_repeat": [{"l3_hit_tokens": m["l3_hit_tokens"], "written_bytes": m["written_bytes"],
                            "ttft_mean_s": m["ttft_s"]["mean"], "hit_total": m["hit_rate"]["total"]} for m in ms],
        }
    out["summary"] = "; ".join(
        f"{v}: L3 hit {d['hit_rate']['l3']:.3f} ({d['l3_hit_tokens']:.0f} tokens), total hit {d['hit_rate']['total']:.3f}, "
        f"written {d['written_mib']:.1f} MiB, {d['l3_hit_tokens_per_mib_written']:.0f} L3 hit tokens/MiB written, "
        f"TTFT mean {d['ttft_s']['mean']:.3f} p50 {d['ttft_s']['p50']:.3f} s"
        for v, d in out["variants"].items()) + (f" (L3 {args.pressure_capacity_mb} MiB per instance, {len(trace)} requests, "
                                                 "medians of 2 repeats)")
    return out
