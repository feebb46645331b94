"""What-if tool (not a measurement, not collected by pytest): an engine-level simulation of SGLang's
prefill/decode loop with chunked prefill on the benchmark's own traces (`workload.make_trace`,
same seeds and rates), driven by stock first-come-first-served or by the plugin's `FairPolicy`.

Engine rules mirrored: the chunked (long) request is offered the pass budget first; waiting
requests follow in the policy's order; one partially prefilled request at most; a pass with any
prefill runs no decode (decode only in passes without prefill, or in the policy's decode steps);
`extra_tokens` of a plan enlarge that pass's budget for riding one-chunk requests.

Cost model (seconds), refitted to this CPU's measurements of the tiny model in float32 (quiet
machine, run of 2026-11-30 09:09): a prefill pass costs PASS_BASE + sum over its rows of
PER_TOKEN * k + CTX_READ * c + ATTN * k * c + ATTN2 * k * c^2 (k new tokens at context c). With
k = 128 this gives ~20 ms at short context and the measured solo TTFT of 1.21 s / 6.26 s for
2.5K / 5K prompts (so ~0.13 s / ~0.33 s per chunk at 2.5K / 4.5K context). How the context term
splits between a per-pass part (reading the cached K/V) and a per-token part (attention) decides
what a smaller long chunk costs; `--ctx-model` picks: `token` (all per token), `pass` (the linear
term per pass), `half`. A decode step costs DECODE_BASE + DECODE_ROW per running request plus its
attention. Only ratios between policies are meant; `--check` prints the simulated ratios of the
last recorded configuration next to the recorded ones.

`--predict RUN.json` scales each variant by the recorded run of the reference variant (`ride 128`,
the 11:35 run's config): predicted ratio = simulated(variant) / simulated(ref) x recorded(fair_sched)
per seed and metric, over the recorded fcfs. Use it where the model's absolute numbers are off
(its fcfs TPOT is: requests that real fcfs finishes just before a long prompt arrives are, in the
model, a few decode steps short and stall behind it).

    python benchmarks/fair_sched/sim_engine.py --check
    python benchmarks/fair_sched/sim_engine.py --seeds 6
    git show b96567d:benchmarks/results/fair_sched.json > /tmp/fair_1135.json  # the 11:35 run
    python benchmarks/fair_sched/sim_engine.py --capacity 3.7201 --predict /tmp/fair_1135.json
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, PassPlan, QuotaParams, WaitingItem  # noqa: E402
from workload import MIXES, make_trace, pct  # noqa: E402

PASS_BASE, PER_TOKEN = 0.008, 9.4e-5
CTX_LINEAR = 1.246e-5  # per context token for a 128-token chunk (split by --ctx-model)
ATTN2 = 1.253e-8 / 128  # per new token x context^2
DECODE_BASE, DECODE_ROW = 0.008, 0.0008
CAPACITY = 4.1458765290800725  # req/s of the issue mix, measured at 09:09 (the recorded run's)


@dataclass
class Costs:
    ctx_read: float
    attn: float

    def row(self, k: int, c: int) -> float:
        return PER_TOKEN * k + self.ctx_read * c + self.attn * k * c + ATTN2 * k * c * c

    def prefill(self, rows: list[tuple[int, int]]) -> float:
        return PASS_BASE + sum(self.row(k, c) for k, c in rows)

    def decode(self, contexts: list[int]) -> float:
        return DECODE_BASE + sum(DECODE_ROW + self.ctx_read * c + self.attn * c + ATTN2 * c * c for c in contexts)


def costs(model: str) -> Costs:
    share = {"token": 0.0, "pass": 1.0, "half": 0.5}[model]
    return Costs(ctx_read=CTX_LINEAR * share, attn=CTX_LINEAR * (1 - share) / 128)


@dataclass
class Req:
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


def simulate(jobs: list[Any], make_policy: Callable[[], FairPolicy] | None, cm: Costs, chunk: int = 128) -> dict[str, Any]:
    reqs = [Req(i, j.arrival_s, len(j.input_ids), j.max_new_tokens, j.kind == "long") for i, j in enumerate(jobs)]
    policy = make_policy() if make_policy else None
    t, nxt, finished = 0.0, 0, 0
    waiting: list[Req] = []
    running: list[Req] = []
    chunked: Req | None = None

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
        budget = chunk
        plan: PassPlan | None = None
        if policy is not None:
            if policy.active is not None and (chunked is None or str(chunked.rid) != policy.active.rid):
                policy.active = None
            if chunked is not None:
                plan = policy.plan(items(), bool(running), now=t, running_reqs=len(running))
        parked = plan is not None and plan.action == "yield"
        batch: list[tuple[Req, int]] = []
        if (waiting or chunked is not None) and not (parked and plan is not None and plan.yield_to == "decode"):
            if chunked is not None and not parked:
                cap = budget if plan is None or plan.long_limit is None else min(budget, plan.long_limit)
                take = min(chunked.work - chunked.done, cap)
                batch.append((chunked, take))
                budget -= take
                if plan is not None:
                    budget += plan.extra_tokens
            order = [waiting[k] for k in policy.order(items())] if policy is not None else list(waiting)
            # SGLang frees the chunked slot inside the pass that runs the last chunk.
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
            t += cm.prefill([(k, r.done) for r, k in batch])
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
            if policy is not None:
                policy.note_decode(t)
            t += cm.decode([r.work + r.tokens for r in running])
            finished += decode_one(t)
        else:
            t = reqs[nxt].arrival if nxt < len(reqs) else t
    ttft = [r.ttft for r in reqs]
    longs = sorted(r.ttft for r in reqs if r.long)
    tpot = [(r.finish_s - r.first_s) / (r.out - 1) for r in reqs]
    return {"mean": statistics.fmean(ttft), "p90": pct(ttft, 0.9), "p99": pct(ttft, 0.99),
            "short_p90": pct([r.ttft for r in reqs if not r.long], 0.9), "long_mean": statistics.fmean(longs),
            "tpot": statistics.fmean(tpot), "throughput": len(reqs) / (max(r.finish_s for r in reqs) - reqs[0].arrival)}


def params(**kw: Any) -> QuotaParams:
    base: dict[str, Any] = dict(budget_tokens=128, base_quota_tokens=128, quota_growth=1.5, max_quota_tokens=512,
                                max_yields=64, long_min_share=0.25, decode_every_chunks=2)
    base.update(kw)
    return QuotaParams(**base)


VARIANTS: dict[str, Any] = {
    "fcfs": None,
    "fair 09:09 (share 0.25)": lambda: FairPolicy(params()),
    "ride 128": lambda: FairPolicy(params(short_extra_tokens=128)),
    "ride 128, decode /3": lambda: FairPolicy(params(short_extra_tokens=128, decode_every_chunks=3)),
    "ride 128, sjf cap 2": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2)),
    "ride 128, sjf cap 1": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=1)),
    "ride 256": lambda: FairPolicy(params(short_extra_tokens=256)),
    "ride 128, decode 0.2s": lambda: FairPolicy(params(short_extra_tokens=128, decode_every_chunks=1, decode_interval_s=0.2)),
    "ride 128, decode 0.3s": lambda: FairPolicy(params(short_extra_tokens=128, decode_every_chunks=1, decode_interval_s=0.3)),
    "ride 128, decode 0.4s": lambda: FairPolicy(params(short_extra_tokens=128, decode_every_chunks=1, decode_interval_s=0.4)),
    "ride, 0.3s, sjf cap 2": lambda: FairPolicy(params(short_extra_tokens=128, decode_every_chunks=1, decode_interval_s=0.3,
                                                        long_overtake_max=2)),
    "ride, sjf cap 2, every chunk": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=1)),
    "ride, sjf cap 2, busy 8": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, busy_decode_reqs=8)),
    "ride, sjf cap 2, busy 12": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, busy_decode_reqs=12)),
    "ride, sjf cap 2, busy 16": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, busy_decode_reqs=16)),
    "ride, sjf cap 2, busy 24": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, busy_decode_reqs=24)),
    "ride, sjf cap 2, /3, busy 12": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=3,
                                                               busy_decode_reqs=12)),
    "ride, sjf cap 2, /3, busy 16": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=3,
                                                               busy_decode_reqs=16)),
    "ride, sjf cap 2, /4, busy 12": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=4,
                                                               busy_decode_reqs=12)),
    "defaults + max gap 0.3 s": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=3,
                                                           busy_decode_reqs=12, decode_max_gap_s=0.3)),
    "defaults + max gap 0.5 s": lambda: FairPolicy(params(short_extra_tokens=128, long_overtake_max=2, decode_every_chunks=3,
                                                           busy_decode_reqs=12, decode_max_gap_s=0.5)),
}

METRICS = ("mean", "p90", "p99", "short_p90", "long_mean", "tpot", "throughput")


def predict(args: argparse.Namespace, cm: Costs, ref: str = "ride 128") -> None:
    import json

    with open(args.predict) as f:
        runs = [r for r in json.load(f)["runs"] if r.get("mix", "issue") == args.mix]
    pick = {"mean": ("ttft_s", "mean"), "p90": ("ttft_s", "p90"), "p99": ("ttft_s", "p99"),
            "long_mean": ("ttft_long_s", "mean"), "tpot": ("tpot_s", "mean")}
    rec = {(r["policy"], r["load"], r["seed"]): {m: r[a][b] for m, (a, b) in pick.items()} for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    for load in (0.6, 0.85):
        sims: dict[tuple[str, int], dict[str, float]] = {}
        for seed in seeds:
            jobs = make_trace(MIXES[args.mix], args.requests, load * args.capacity, seed)
            for name, make in VARIANTS.items():
                if make is not None:
                    sims[(name, seed)] = simulate(jobs, make, cm)
        print(f"load {load} ({args.ctx_model}): predicted ratio to the recorded fcfs, mean of seeds (per seed)")
        for name in (n for n, mk in VARIANTS.items() if mk is not None):
            cols = []
            for m in pick:
                pred = [sims[(name, s)][m] / sims[(ref, s)][m] * rec[("fair_sched", load, s)][m] for s in seeds]
                base = [rec[("fcfs", load, s)][m] for s in seeds]
                cols.append(f"{m}={sum(pred) / sum(base):.2f}x(" + "/".join(f"{p / b:.2f}" for p, b in zip(pred, base)) + ")")
            print(f"  {name:28s} " + " ".join(cols))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", choices=sorted(MIXES), default="issue")
    ap.add_argument("--capacity", type=float, default=CAPACITY)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--ctx-model", choices=("token", "pass", "half"), default="half")
    ap.add_argument("--check", action="store_true", help="only fcfs and the recorded fair_sched config, per seed")
    ap.add_argument("--predict", default="", help="a recorded results json of the reference variant (see module doc)")
    args = ap.parse_args()
    cm = costs(args.ctx_model)
    if args.predict:
        predict(args, cm)
        return
    variants = {k: VARIANTS[k] for k in ("fcfs", "fair 09:09 (share 0.25)")} if args.check else VARIANTS
    for load in (0.6, 0.85):
        res: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
        for seed in range(args.seeds):
            jobs = make_trace(MIXES[args.mix], args.requests, load * args.capacity, seed)
            for name, make in variants.items():
                res[name].append(simulate(jobs, make, cm))
        base = {m: statistics.fmean(x[m] for x in res["fcfs"]) for m in METRICS}
        print(f"load {load} ({args.ctx_model}): fcfs " + " ".join(f"{m}={v:.3f}" for m, v in base.items()))
        for name, rows in res.items():
            avg = {m: statistics.fmean(x[m] for x in rows) for m in METRICS}
            per_seed = " ".join(f"s{s}:p99={rows[s]['p99'] / res['fcfs'][s]['p99']:.2f}x" for s in range(len(rows)))
            print(f"  {name:26s} " + " ".join(f"{m}={avg[m] / base[m]:.2f}x" for m in METRICS) + f"  [{per_seed}]")


if __name__ == "__main__":
    main()
