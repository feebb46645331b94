"""Benchmark helper (not collected by pytest): measure the scheduler pass costs of the tiny model
on this CPU, to fit `sim_engine.py`'s cost model.

A `sitecustomize` on the server's PYTHONPATH times every `Scheduler.run_batch` +
`process_batch_result` in the scheduler process and writes one JSON line per pass (mode, prefix
and extend length of each prefill row, decode rows, seconds). Scenarios, on fcfs servers with
chunk 128 and chunk 32: a long prompt alone (chunk cost against context), bursts of one-chunk
prompts (cost per prefilled token and per request), and many requests decoding together
(cost per decode row). Prints a least-squares fit; `--out` keeps the raw passes.

    python benchmarks/fair_sched/pass_costs.py --out /tmp/fs_passes.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import Job, run_jobs, sglang_server  # noqa: E402

SITE = r'''
import json, os, time
_out = os.environ.get("KLLM_PASS_TIMING")
if _out:
    import builtins
    _imp = builtins.__import__
    _done = []
    def _hook(name, *a, **k):
        m = _imp(name, *a, **k)
        if not _done and name.startswith("sglang.srt.managers.scheduler"):
            _patch()
        return m
    def _patch():
        import sys
        mod = sys.modules.get("sglang.srt.managers.scheduler")
        if _done or mod is None or not hasattr(mod, "Scheduler"):
            return
        _done.append(1)
        S = mod.Scheduler
        run0 = S.run_batch
        def run_batch(self, batch, *a, **k):
            # On CPU the forward is synchronous, so run_batch's time is the pass's compute time;
            # the gap between two starts also counts scheduling and result processing.
            dec = {id(x) for x in (getattr(batch, "decoding_reqs", None) or [])}
            mode = batch.forward_mode.name
            rows = []
            if batch.forward_mode.is_extend() or mode == "MIXED":
                for q in batch.reqs:
                    if id(q) not in dec:
                        rows.append([int(q.prefix_len), int(q.extend_end) - int(q.prefix_len)])
            t0 = time.perf_counter()
            r = run0(self, batch, *a, **k)
            t1 = time.perf_counter()
            with open(_out, "a") as fh:
                fh.write(json.dumps({"mode": mode, "rows": rows, "decode": len(batch.reqs) - len(rows),
                                     "t0": t0, "s": t1 - t0}) + "\n")
            return r
        S.run_batch = run_batch
    builtins.__import__ = _hook
'''


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 4090) for _ in range(n)]


def scenario(url: str, rng: random.Random, tag: str, full: bool) -> None:
    # a long prompt alone: chunk cost against context
    run_jobs(url, [Job(f"{tag}-long", 0.0, ids(rng, 5000), 4, "long")])
    if not full:
        return
    # bursts of one-chunk prompts, several sizes (prefill passes at short context)
    for k, n in enumerate((32, 64, 128)):
        run_jobs(url, [Job(f"{tag}-b{k}-{j}", 0.0, ids(rng, n), 4, "short") for j in range(6)])
    # decode with many rows
    for nrows in (1, 8, 24):
        run_jobs(url, [Job(f"{tag}-d{nrows}-{j}", 0.0, ids(rng, 40), 48, "short") for j in range(nrows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 32])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through `with srv` so the server stops
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    site = tempfile.mkdtemp(prefix="kllm-passcost-")
    with open(os.path.join(site, "sitecustomize.py"), "w", encoding="utf-8") as fh:
        fh.write(SITE)
    result: dict[str, list[dict]] = {}
    for chunk in args.chunks:
        log = os.path.join(site, f"passes_{chunk}.jsonl")
        env = {"KLLM_PASS_TIMING": log,
               "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)}
        srv = sglang_server(str(tiny_llama_path()), extra_args=["--chunked-prefill-size", str(chunk), "--dtype", "float32"],
                            max_total_tokens=65536, env=env)
        with srv:
            rng = random.Random(5)
            run_jobs(srv.base_url, [Job("warm", 0.0, ids(rng, 300), 4, "short")])
            open(log, "w").close()
            scenario(srv.base_url, rng, f"c{chunk}", chunk == args.chunks[0])
        with open(log, encoding="utf-8") as fh:
            result[str(chunk)] = [json.loads(line) for line in fh]
        print(f"chunk {chunk}: {len(result[str(chunk)])} passes", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    summarize(result)


def summarize(result: dict[str, list[dict]]) -> None:
    import statistics

    for chunk, passes in result.items():
        print(f"== chunk {chunk}")
        ext = [p for p in passes if p["mode"] == "EXTEND" and p["decode"] == 0]
        longs = [p for p in ext if len(p["rows"]) == 1 and (p["rows"][0][0] > 0)]
        buckets: dict[int, list[float]] = {}
        for p in longs:
            buckets.setdefault(p["rows"][0][0] // 500 * 500, []).append(p["s"])
        for ctx, xs in sorted(buckets.items()):
            print(f"  long chunk at context {ctx:5d}-{ctx + 499}: median {statistics.median(xs) * 1000:7.1f} ms (n={len(xs)})")
        shorts: dict[tuple[int, int], list[float]] = {}
        for p in ext:
            if all(r[0] == 0 for r in p["rows"]):
                shorts.setdefault((len(p["rows"]), sum(r[1] for r in p["rows"])), []).append(p["s"])
        for (n, tok), xs in sorted(shorts.items()):
            print(f"  short pass {n} reqs {tok:4d} tokens: median {statistics.median(xs) * 1000:7.1f} ms (n={len(xs)})")
        dec: dict[int, list[float]] = {}
        for p in passes:
            if p["mode"] == "DECODE":
                dec.setdefault(p["decode"], []).append(p["s"])
        for n, xs in sorted(dec.items()):
            if len(xs) >= 3:
                print(f"  decode {n:3d} rows: median {statistics.median(xs) * 1000:7.1f} ms (n={len(xs)})")
        gaps = [b["t0"] - a["t0"] - a["s"] for a, b in zip(passes, passes[1:]) if b["t0"] - a["t0"] - a["s"] < 0.05]
        if gaps:
            print(f"  between passes (scheduling, results; busy gaps < 50 ms): median {statistics.median(gaps) * 1000:.1f} ms (n={len(gaps)})")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        with open(sys.argv[2], encoding="utf-8") as fh:
            summarize(json.load(fh))
    else:
        main()
