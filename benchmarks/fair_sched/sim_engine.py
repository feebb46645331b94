"""What-if tool (not a measurement, not collected by pytest): an engine-level simulation of SGLang's
prefill/decode loop with chunked prefill, driven by stock first-come-first-served or by the
plugin's `FairPolicy`, with and without decode rows mixed into prefill passes.

Used to choose fair_sched's defaults (mixed decode on, no decode yields, minimum share 0.25)
before spending machine time. Costs are assumptions shaped after solo measurements of the tiny
model on this CPU (a 128-token chunk ~0.03 s plus attention growing with context, a 3.75K prompt
~3 s alone, a decode step ~0.02 s + 2 ms per request); only ratios between policies mean anything.

    python benchmarks/fair_sched/sim_engine.py --capacity 3.8 --seeds 6
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, PassPlan, QuotaParams, WaitingItem

PASS_BASE_S, PER_TOKEN_S, ATTN_S = 0.012, 0.00012, 3.1e-7  # prefill pass: base + per token + per token x context
DECODE_BASE_S, DECODE_PER_REQ_S, MIXED_ROW_S = 0.02, 0.002, 0.0003


@dataclass
class SimReq:
    rid: int
    arrival: float
    work: int
    out: int
    long: bool
    done: int = 0
    ttft: float = float("nan")
    first_s: float = 0.0
    tokens: int = 0
    finish_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def trace(n: int, rate: float, seed: int, long_frac: float, lo: int, hi: int, log_uniform: bool) -> list[SimReq]:
    rng = random.Random(seed)
    longs = set(rng.sample(range(n), max(1, round(n * long_frac))))
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        if i in longs:
            w = int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if log_uniform else rng.randint(lo, hi)
        else:
            w = rng.randint(32, 128)
        out.append(SimReq(i, t, w, rng.randint(16, 32), i in longs))
    return out


def run(reqs: list[SimReq], policy: FairPolicy | None, mixed: bool, chunk: int = 128) -> dict[str, float]:
    reqs = [SimReq(r.rid, r.arrival, r.work, r.out, r.long) for r in reqs]
    t, nxt, finished = 0.0, 0, 0
    waiting: list[SimReq] = []
    running: list[SimReq] = []
    chunked: SimReq | None = None

    def items() -> list[WaitingItem]:
        return [WaitingItem(str(r.rid), r.work - r.done, r.rid) for r in waiting]

    def decode_one(now: float) -> int:
        done = 0
        for r in list(running):
            r.tokens += 1
            if r.tokens >= r.out:
                r.finish_s = now
                running.remove(r)
                done += 1
        return done

    while finished < len(reqs):
        while nxt < len(reqs) and reqs[nxt].arrival <= t:
            waiting.append(reqs[nxt])
            nxt += 1
        if not waiting and chunked is None and not running:
            t = reqs[nxt].arrival
            continue
        budget = chunk - (len(running) if mixed else 0)
        plan: PassPlan | None = None
        if policy is not None:
            if policy.active is not None and (chunked is None or str(chunked.rid) != policy.active.rid):
                policy.active = None
            if chunked is not None:
                plan = policy.plan(items(), bool(running), budget if mixed else None)
                if plan.action == "yield" and plan.yield_to == "short":
                    budget = chunk  # the yield pass carries no decode rows
        parked = plan is not None and plan.action == "yield"
        batch: list[tuple[SimReq, int]] = []
        if (waiting or chunked is not None) and not (parked and plan is not None and plan.yield_to == "decode"):
            if chunked is not None and not parked:
                cap = budget if plan is None or plan.long_limit is None else min(budget, plan.long_limit)
                take = min(chunked.work - chunked.done, cap)
                batch.append((chunked, take))
                budget -= take
            order = [waiting[k] for k in policy.order(items(), budget)] if policy is not None else list(waiting)
            slot_free = chunked is None or (bool(batch) and chunked.done + batch[0][1] >= chunked.work)
            for r in order:
                need = r.work - r.done
                if budget <= 0:
                    break
                if need <= budget:
                    batch.append((r, need))
                    budget -= need
                    waiting.remove(r)
                elif slot_free and not parked:
                    batch.append((r, budget))
                    waiting.remove(r)
                    budget = 0
                    slot_free = False
                else:
                    break
        if batch:
            mix_now = mixed and not parked
            t += PASS_BASE_S + sum(PER_TOKEN_S * k + ATTN_S * k * (r.done + k / 2) for r, k in batch)
            t += MIXED_ROW_S * len(running) if mix_now else 0.0
            if mix_now:
                finished += decode_one(t)
            cont = None
            for r, k in batch:
                r.done += k
                if r.done >= r.work:
                    r.ttft, r.first_s, r.tokens = t - r.arrival, t, 1
                    running.append(r)
                    if policy is not None and policy.active is not None and policy.active.rid == str(r.rid):
                        policy.record_run(str(r.rid), k)
                        policy.finish_long(str(r.rid))
                else:
                    cont = r
                    if policy is not None:
                        if policy.active is None:
                            policy.start_long(str(r.rid), r.work - r.done + k)
                        policy.record_run(str(r.rid), k)
            chunked = cont if cont is not None else (chunked if chunked is not None and chunked.done < chunked.work else None)
        elif running:
            t += DECODE_BASE_S + DECODE_PER_REQ_S * len(running)
            finished += decode_one(t)
        else:
            t = reqs[nxt].arrival if nxt < len(reqs) else t
    ttft = [r.ttft for r in reqs]
    longs = [r.ttft for r in reqs if r.long]
    tpot = [(r.finish_s - r.first_s) / (r.out - 1) for r in reqs]

    def q(xs: list[float], p: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]

    return {"mean": statistics.fmean(ttft), "p90": q(ttft, 0.9), "p99": q(ttft, 0.99),
            "short_p90": q([r.ttft for r in reqs if not r.long], 0.9), "long_mean": statistics.fmean(longs),
            "tpot": statistics.fmean(tpot), "throughput": len(reqs) / (max(r.finish_s for r in reqs) - reqs[0].arrival)}


def params(**kw: Any) -> QuotaParams:
    base: dict[str, Any] = dict(budget_tokens=128, base_quota_tokens=128, quota_growth=1.5, max_quota_tokens=512,
                                max_yields=64, long_min_share=0.25, decode_every_chunks=0)
    base.update(kw)
    return QuotaParams(**base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=float, default=3.8)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--heavy", action="store_true", help="10%% long prompts, log-uniform 2K-8K")
    args = ap.parse_args()
    mix = (0.10, 2000, 8000, True) if args.heavy else (0.05, 2500, 5000, False)
    variants: dict[str, tuple[Any, bool]] = {
        "fcfs": (None, False), "fcfs+mixed": (None, True),
        "fair, decode yield /2": (lambda: FairPolicy(params(decode_every_chunks=2)), False),
        "fair, no mixing": (lambda: FairPolicy(params()), False),
        "fair (defaults)": (lambda: FairPolicy(params()), True),
        "fair, share 0.5": (lambda: FairPolicy(params(long_min_share=0.5)), True),
    }
    for load in (0.6, 0.85):
        res: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
        for seed in range(args.seeds):
            tr = trace(args.requests, load * args.capacity, seed, *mix)
            for name, (make, mixed) in variants.items():
                res[name].append(run(tr, make() if make else None, mixed))
        base = {m: statistics.fmean(x[m] for x in res["fcfs"]) for m in res["fcfs"][0]}
        print(f"load {load}: fcfs " + " ".join(f"{m}={v:.3f}" for m, v in base.items()))
        for name, rows in res.items():
            avg = {m: statistics.fmean(x[m] for x in rows) for m in rows[0]}
            print(f"  {name:22s} " + " ".join(f"{m}={avg[m] / base[m]:.2f}x" for m in avg))


if __name__ == "__main__":
    main()
