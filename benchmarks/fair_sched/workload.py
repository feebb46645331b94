"""Benchmark helper (not library code): the traffic mixes of the fair_sched benchmark and the
per-run summary (TTFT overall / short / long, TPOT, throughput).

Mixes (prompt tokens; outputs 16-32 tokens, ignore_eos; Poisson arrivals):
* issue: 95% one-chunk prompts of 32-128 tokens, 5% long prompts of 2.5K-5K (uniform).
* heavy: 90% one-chunk prompts of 32-128 tokens, 10% long prompts log-uniform in 2K-8K: twice
  the long share and a tail to 8K (the tiny model's context is 8192).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

from kllm_plugins.bench.stats import quantile

from serving import Job, Outcome


@dataclass(frozen=True)
class Mix:
    name: str
    long_frac: float
    long_min: int
    long_max: int
    log_uniform: bool

    def long_len(self, rng: random.Random) -> int:
        if self.log_uniform:
            return int(round(math.exp(rng.uniform(math.log(self.long_min), math.log(self.long_max)))))
        return rng.randint(self.long_min, self.long_max)


MIXES = {
    "issue": Mix("issue", 0.05, 2500, 5000, False),
    "heavy": Mix("heavy", 0.10, 2000, 8000, True),
    "smoke": Mix("smoke", 0.10, 600, 1200, False),  # pipeline check only, never recorded
}


def make_trace(mix: Mix, n: int, rate: float, seed: int, prefix: str = "") -> list[Job]:
    """n requests with exactly round(n * long_frac) long ones at random positions."""
    rng = random.Random(seed)
    long_idx = set(rng.sample(range(n), max(1, round(n * mix.long_frac))))
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        is_long = i in long_idx
        plen = mix.long_len(rng) if is_long else rng.randint(32, 128)
        ids = [rng.randrange(5, 4090) for _ in range(plen)]
        jobs.append(Job(f"{prefix}s{seed}-r{i}", t, ids, rng.randint(16, 32), "long" if is_long else "short"))
    return jobs


def pct(xs: list[float], q: float) -> float:
    """The harness's quantile (numpy.percentile's linear method); NaN for no samples."""
    return quantile(xs, q) if xs else float("nan")


def _dist(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"mean": statistics.fmean(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "p95": pct(xs, 0.95),
            "p99": pct(xs, 0.99), "max": max(xs)}


def during_long(outs: list[Outcome]) -> list[float]:
    """TTFT of the short requests that arrived while a long request was waiting for its first token."""
    windows = [(o.arrival_s, o.arrival_s + o.ttft_s) for o in outs if o.kind == "long"]
    return [o.ttft_s for o in outs if o.kind == "short" and any(a <= o.arrival_s <= b for a, b in windows)]


def summarize(outs: list[Outcome], wall_s: float, solo_long_s: Any) -> dict[str, Any]:
    """`solo_long_s(tokens)`: the measured solo TTFT of a long prompt (for the stretch ratio)."""
    hit = during_long(outs)
    tpot = [o.tpot_s for o in outs if o.output_len > 1]
    longs = [o for o in outs if o.kind == "long"]
    stretch = [o.ttft_s / solo_long_s(o.prompt_len) for o in longs]
    return {
        "ttft_s": _dist([o.ttft_s for o in outs]),
        "ttft_short_s": _dist([o.ttft_s for o in outs if o.kind == "short"]),
        "ttft_long_s": _dist([o.ttft_s for o in longs]),
        "ttft_short_during_long_s": {"n": len(hit), "mean": statistics.fmean(hit) if hit else float("nan")},
        # NaN where nothing decodes (every output one token: the prefill side of a disaggregated pair)
        "tpot_s": {"mean": statistics.fmean(tpot) if tpot else math.nan, "p50": pct(tpot, 0.5), "p90": pct(tpot, 0.9)},
        # end to end (arrival to last token) and its decode part: where a TTFT saving went
        "e2e_s": {"mean": statistics.fmean(o.latency_s for o in outs), "p99": pct([o.latency_s for o in outs], 0.99)},
        "decode_s": {"mean": statistics.fmean(o.latency_s - o.ttft_s for o in outs)},
        "long_ttft_over_solo": ({"max": max(stretch), "mean": statistics.fmean(stretch)} if stretch
                                else {"max": math.nan, "mean": math.nan}),
        "throughput_req_s": len(outs) / wall_s,
        "output_tok_s": sum(o.output_len for o in outs) / wall_s,
        "wall_s": wall_s,
        "cached_prompt_tokens": sum(o.cached_tokens for o in outs),
    }
