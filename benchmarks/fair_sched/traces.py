"""Benchmark helper (not library code): the fair_sched trace family, one seeded generator, written
as Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`) so that
`python -m sglang.bench_serving --dataset-name mooncake --dataset-path FILE` replays it too.

Every trace is written at a mean rate of 1 request/s; a run at rate R replays it with its
timestamps divided by R (bench_serving: `--mooncake-slowdown-factor 1/R`). Lengths are given in
chunks of the target scale, so one definition serves the CPU (chunk 128, context 8192) and the
production-scale simulation (chunk 8192, prompts up to 500K):

* `issue`: 95% prompts of 0.25-1 chunk, 5% of 20-40 chunks (the first fair_sched issue's mix);
* `multichunk`: 90% prompts log-uniform in 0.25-4 chunks (shorts spanning 1-4 chunks), 10% of
  12-24 chunks;
* `lognormal`: one heavy-tailed lognormal (median 2 chunks, sigma 1.4), cut at the longest prompt;
* `bursty`: issue 27's losing trace (90% of 0.25-2 chunks, 10% of 12-24 chunks) with on/off
  arrivals: the Poisson rate alternates between 1.43x and 0.57x of the mean every `period_s`;
* `mooncake`: the arrival gaps, input/output lengths and shared prefix blocks of the public
  Mooncake FAST'25 conversation trace (benchmarks/data/mooncake-fast25, a window of it chosen by
  the seed), lengths scaled by `mooncake_scale` (CPU: 1/16, so its 126K-token maximum becomes
  7.9K of the tiny model's 8K context; production: 1, its own lengths) and cut at the longest
  prompt.

Outputs: synthetic traces draw 16-32 tokens on the CPU scale and 64-512 at production scale; the
Mooncake trace's own output lengths are scaled like its inputs (at least 2). `hash_ids` come in
`block` -token blocks (128: bench_serving's mooncake loader writes ~129 tokens per id, so it
replays about these lengths); the synthetic traces share no blocks, the Mooncake trace keeps
its sharing (two scaled blocks are equal when their source blocks are).

    python benchmarks/fair_sched/traces.py --scale cpu --seeds 3 --requests 200 --out /tmp/fair_traces
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE = os.path.join(os.path.dirname(HERE), "data", "mooncake-fast25", "conversation_trace_first1500.jsonl.gz")
TRACES = ("issue", "multichunk", "lognormal", "bursty", "mooncake")


@dataclass(frozen=True)
class Scale:
    name: str
    chunk: int
    max_prompt: int
    out_lo: int
    out_hi: int
    mooncake_scale: float
    period_s: float
    """On/off period of `bursty`, seconds at the mean rate of 1 req/s (scaled with the rate)."""
    block: int = 128


def gpu_scale(trace_chunk: int, max_prompt: int, out_lo: int, out_hi: int) -> Scale:
    """The GPU harness's scale (benchmarks/gpu/fair_sched_gpu.py): lengths in chunks of `trace_chunk`
    cut at `max_prompt`, outputs of `out_lo`-`out_hi` tokens; the simulations that replay its runs
    build the same."""
    return Scale(f"gpu{trace_chunk}", trace_chunk, max_prompt, out_lo, out_hi, 1 / 4, 14.0)


SCALES = {
    "cpu": Scale("cpu", 128, 8192 - 64, 16, 32, 1 / 16, 14.0),
    "production": Scale("production", 8192, 500_000, 64, 512, 1.0, 14.0),
}


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    """At a mean rate of 1 req/s."""
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def _lengths(trace: str, sc: Scale, rng: random.Random, n: int) -> list[int]:
    c = sc.chunk

    def u(lo: float, hi: float) -> int:
        return int(round(rng.uniform(lo, hi) * c))

    def logu(lo: float, hi: float) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))) * c))

    if trace == "lognormal":
        return [min(max(int(rng.lognormvariate(math.log(2 * c), 1.4)), 16), sc.max_prompt) for _ in range(n)]
    share, short, long_ = {"issue": (0.05, lambda: u(0.25, 1.0), lambda: u(20, 40)),
                           "multichunk": (0.10, lambda: logu(0.25, 4.0), lambda: u(12, 24)),
                           "bursty": (0.10, lambda: u(0.25, 2.0), lambda: u(12, 24))}[trace]
    long_idx = set(rng.sample(range(n), max(1, round(n * share))))
    return [min(long_() if i in long_idx else short(), sc.max_prompt) for i in range(n)]


def _arrivals(trace: str, sc: Scale, rng: random.Random, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        rate = 1.0
        if trace == "bursty":
            rate = 1.43 if int(t // sc.period_s) % 2 == 0 else 0.57
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _unique_blocks(n_tokens: int, block: int, next_id: Iterator[int]) -> tuple[int, ...]:
    return tuple(next(next_id) for _ in range(max(1, math.ceil(n_tokens / block))))


def _mooncake(sc: Scale, rng: random.Random, n: int) -> list[TraceRequest]:
    with gzip.open(MOONCAKE, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if n > len(rows):
        raise ValueError(f"the Mooncake subset has {len(rows)} requests, asked for {n}")
    start = rng.randrange(0, len(rows) - n + 1)
    window = rows[start:start + n]
    t0 = window[0]["timestamp"]
    span_s = max((window[-1]["timestamp"] - t0) / 1000.0, 1e-3)
    speed = (n - 1) / span_s if n > 1 else 1.0  # to a mean rate of 1 req/s
    ids: dict[tuple[object, ...], int] = {}
    src_block = 512 * sc.mooncake_scale  # one source block, in scaled tokens
    out: list[TraceRequest] = []
    for r in window:
        inp = min(max(int(round(r["input_length"] * sc.mooncake_scale)), 16), sc.max_prompt)
        outl = max(int(round(r["output_length"] * sc.mooncake_scale)), 2)
        src = list(r["hash_ids"])
        blocks = []
        for j in range(max(1, math.ceil(inp / sc.block))):
            # Scaled block j covers source blocks lo..hi; equal spans (and offsets) are shared.
            lo = int(j * sc.block // src_block)
            hi = int(math.ceil((j + 1) * sc.block / src_block)) - 1
            span = tuple(src[lo:hi + 1])
            key = (span, j * sc.block - lo * src_block) if span else ("own", len(out), j)
            blocks.append(ids.setdefault(key, len(ids)))
        out.append(TraceRequest((r["timestamp"] - t0) / 1000.0 * speed, inp, outl, tuple(blocks)))
    return out


def make(trace: str, scale: str | Scale, n: int, seed: int) -> list[TraceRequest]:
    """`n` requests of `trace` at a mean rate of 1 req/s (seeded)."""
    sc = SCALES[scale] if isinstance(scale, str) else scale
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; one of {TRACES}")
    rng = random.Random(f"{trace}/{sc.name}/{seed}")
    if trace == "mooncake":
        return _mooncake(sc, rng, n)
    lens = _lengths(trace, sc, rng, n)
    times = _arrivals(trace, sc, rng, n)
    counter = iter(range(10**12))
    return [TraceRequest(t, ln, rng.randint(sc.out_lo, sc.out_hi), _unique_blocks(ln, sc.block, counter))
            for t, ln in zip(times, lens)]


def write_jsonl(reqs: list[TraceRequest], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in reqs:
            fh.write(json.dumps({"timestamp": int(round(r.arrival_s * 1000)), "input_length": r.input_len,
                                 "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")


def read_jsonl(path: str) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"]))
            for r in rows]


def prompt_ids(r: TraceRequest, block: int = 128, vocab: tuple[int, int] = (5, 4090), salt: str = "") -> list[int]:
    """Token ids of a prompt: each hash id gives the same `block` ids wherever it appears (shared
    prefixes stay shared), cut at `input_len`. `salt` separates the runs of one benchmark."""
    ids: list[int] = []
    for h in r.hash_ids:
        g = random.Random(f"{salt}/{h}")
        ids += [g.randrange(*vocab) for _ in range(block)]
    while len(ids) < r.input_len:  # fewer ids than blocks (a hand-written file): fill deterministically
        ids.append(vocab[0] + len(ids) % (vocab[1] - vocab[0]))
    return ids[:r.input_len]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    ap.add_argument("--traces", nargs="+", default=list(TRACES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for trace in args.traces:
        for seed in range(args.seeds):
            path = os.path.join(args.out, f"{trace}-{args.scale}-s{seed}.jsonl")
            write_jsonl(make(trace, args.scale, args.requests, seed), path)
            print(path)


if __name__ == "__main__":
    main()
