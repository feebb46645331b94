"""Where does an L3 hit pay on this machine? One server at a time (CPU, tiny Llama, SGLang's `file`
L3 or the plugin's file store on the local disk), the same requests against each setup:

for each prefix length n and repeat: a fresh prefix P of n tokens is sent once with a fresh suffix
(HiCache writes P through to L2 and L3), L1 and L2 are flushed, then P is sent again with another
fresh suffix of `--suffix` tokens and that request's TTFT is measured. Which tier served P is read
from SGLang's per-request breakdown.

Setups:
- `recompute`: stock HiCache with a prefetch threshold no prefix reaches: P is always recomputed;
- `stock_load`: stock HiCache with a 16-token threshold: P is always loaded from L3;
- `kv_tiers`: the plugin (adaptive thresholds): loads or recomputes as its fetch-or-recompute rule says;
- `kv_tiers_load`: the plugin's store and hooks, adaptive thresholds off, 16-token threshold: always loads.

Lifetimes are interleaved (A B C D, D C B A, ...). Prints the median TTFT per setup and n, and each
setup against `recompute` as a ratio: below 1 the load paid. Diagnostic for the short-prompt TTFT
gap (docs/kv_tiers.md); `--record` writes benchmarks/results/kv_tiers/<--results-name>.json through
the harness's recorder (the per-request records and the ratios of medians with their spread).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kllm_plugins.bench import stats
from kllm_plugins.bench.record import record as write_record
from kllm_plugins.plugins.kv_tiers.testing import flush, kv_tiers_stats
from kllm_plugins.testing.sglang_server import SGLangServer

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import setup_servers  # noqa: E402
from replay import stream_generate  # noqa: E402

from trace_gen import tokens_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEVER = 1 << 20  # a prefetch threshold no prefix here reaches


# each setup: (bench_tiers setup, HiCache storage extra config)
SETUPS: dict[str, tuple[str, dict[str, int]]] = {
    "recompute": ("hicache", {"prefetch_threshold": NEVER}),
    "stock_load": ("hicache", {"prefetch_threshold": 16}),
    "kv_tiers": ("kv_tiers", {}),
    "kv_tiers_load": ("kv_tiers_fixed", {"prefetch_threshold": 16}),
}


def setup_server(name: str, store: str, threads: int, l1_tokens: int) -> SGLangServer:
    if name not in SETUPS:
        raise SystemExit(f"unknown setup {name!r}")
    setup, l3_extra = SETUPS[name]
    servers, _ = setup_servers(setup, store, None, "", l1_tokens, threads, count=1, **l3_extra)
    return servers[0]


def blocks(start: int, n_tokens: int) -> list[int]:
    return list(range(start, start + n_tokens // 16))


def one_lifetime(name: str, args: argparse.Namespace, space: int) -> list[dict[str, Any]]:
    store = tempfile.mkdtemp(prefix=f"kvt-be-{name}-")
    server = setup_server(name, store, args.server_threads, args.l1_tokens)
    out: list[dict[str, Any]] = []
    try:
        server.start()
        nxt = [space]

        def fresh(n_tokens: int) -> list[int]:
            b = blocks(nxt[0], n_tokens)
            nxt[0] += len(b)
            return b

        for _ in range(args.warmup):  # first requests after a start are slower
            stream_generate(server.base_url, tokens_for(fresh(256)), 1)
        for rep in range(args.repeats):
            for n in args.lengths:
                p = fresh(n)
                stream_generate(server.base_url, tokens_for(p + fresh(args.suffix)), 1)
                time.sleep(args.settle_s)  # the write-through reaches L3
                flush(server.base_url)
                time.sleep(args.settle_s)
                ttft, _, meta = stream_generate(server.base_url, tokens_for(p + fresh(args.suffix)), 1)
                d = meta.get("cached_tokens_details") or {}
                out.append({"setup": name, "n": n, "rep": rep, "ttft_s": ttft,
                            "cached": int(meta.get("cached_tokens", 0)), "l3": int(d.get("storage", 0) or 0)})
        if name.startswith("kv_tiers"):
            time.sleep(0.6)
            st = kv_tiers_stats(server)
            fp = st.get("fetch_policy", {})
            out.append({"setup": name, "stats": {k: fp.get(k) for k in (
                "prefill_tokens_per_s", "l3_bandwidth_bytes_per_s", "l3_prefetch_overhead_s",
                "l3_min_fetch_tokens", "prefill_samples")} | {"prefetch_wait": st.get("prefetch_wait")}})
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="recompute,stock_load,kv_tiers,kv_tiers_load")
    ap.add_argument("--lengths", default="32,64,128,192,256,384")
    ap.add_argument("--suffix", type=int, default=64, help="fresh tokens after the prefix (multiple of 16)")
    ap.add_argument("--repeats", type=int, default=5, help="requests per (setup, length, lifetime)")
    ap.add_argument("--rounds", type=int, default=2, help="lifetimes per setup (interleaved)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--settle-s", type=float, default=0.3)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--l1-tokens", type=int, default=2048)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results-name", default="breakeven", help="benchmarks/results/kv_tiers/<name>.json")
    ap.add_argument("--results-root", default=str(ROOT), help="write results under this folder (smoke runs)")
    ap.add_argument("--out", default="", help="write the raw records here")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    setups = args.setups.split(",")
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    recs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for k, name in enumerate(setups if rnd % 2 == 0 else setups[::-1]):
            t0 = time.perf_counter()
            recs += [r | {"round": rnd} for r in one_lifetime(name, args, (1 + rnd * 10 + k) * (1 << 20))]
            print(f"== {name} round {rnd}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(recs, indent=1) + "\n")
    table = summarize(recs, setups, args.lengths)
    print(table)
    if args.record:
        res = write_record("kv_tiers", args.results_name, command, metrics(recs, setups, args.lengths),
                           root=Path(args.results_root),
                           shared="shared 2-core, several helpers; benchmarks under flock", records=recs)
        print(f"recorded {res}")


def metrics(recs: list[dict[str, Any]], setups: list[str], lengths: list[int]) -> dict[str, Any]:
    """Per setup and prompt length: TTFT spread over repeats and rounds, and the ratio of medians
    against `recompute` (unpaired: the repeats are not matched one to one)."""
    rows = [r for r in recs if "n" in r]
    out: dict[str, Any] = {}
    for n in lengths:
        ttft = {s: [r["ttft_s"] for r in rows if r["setup"] == s and r["n"] == n] for s in setups}
        cell: dict[str, Any] = {f"{s}_ttft_s": {k: v for k, v in stats.spread(xs).items() if k != "repeats"}
                                for s, xs in ttft.items() if xs}
        for s, xs in ttft.items():
            if s != "recompute" and xs and ttft.get("recompute"):
                cell[f"{s}_vs_recompute"] = stats.ratio_of_medians(xs, ttft["recompute"], paired=False)
        out[str(n)] = cell
    return out


def summarize(recs: list[dict[str, Any]], setups: list[str], lengths: list[int]) -> str:
    rows = [r for r in recs if "n" in r]
    med: dict[tuple[str, int], float] = {}
    lines = ["| n | " + " | ".join(f"{s} TTFT ms (L3 tok)" for s in setups) + " | " +
             " | ".join(f"{s}/recompute" for s in setups if s != "recompute") + " |"]
    for n in lengths:
        cells = []
        for s in setups:
            xs = [r for r in rows if r["setup"] == s and r["n"] == n]
            if not xs:
                cells.append("-")
                continue
            med[(s, n)] = stats.quantile([r["ttft_s"] for r in xs], 0.5)
            cells.append(f"{1e3 * med[(s, n)]:.1f} ({stats.quantile([r['l3'] for r in xs], 0.5):.0f})")
        ratios = [f"{med[(s, n)] / med[('recompute', n)]:.2f}x" if (s, n) in med and ("recompute", n) in med
                  else "-" for s in setups if s != "recompute"]
        lines.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    for r in recs:
        if "stats" in r:
            lines.append(f"{r['setup']} round {r['round']}: {json.dumps(r['stats'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
