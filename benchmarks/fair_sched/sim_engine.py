"""What-if tool (not a measurement, not collected by pytest): an engine-level simulation of
SGLang's prefill/decode loop with chunked prefill, on the trace family of `traces.py`, driven by
the stock policies or by the plugin's core.

Policies: `fcfs`; `shortest-prefill-first` (sorts by uncached work and caps the continuing chunk
to make room for shorter waiting requests, as `SchedulePolicy.shortest_prefill_chunk_limit`);
`hrrn` (largest waited-prefill-tokens / uncached first, ties by rid as upstream, i.e. random);
`fair_sched` (the plugin's `FairPolicy`, SGLang's single partial prefill); `fair_multi` (the
plugin's order with several partial prefills, `core/partial.py`: an engine SGLang 0.5.23 is
not). `lpm` equals fcfs here: the model has no prefix cache (the real-server grid runs lpm).

Engine rules mirrored (SGLang 0.5.23): the continuing chunk is offered the pass budget first;
waiting requests follow in the policy's order, whole if they fit, else truncated if no other
request is partial, and the first that can be admitted neither way ends the pass; a pass with a
prefill runs no decode (decode only in passes without prefill, or in the plugin's decode steps).

Cost models (seconds; a prefill row of k new tokens at context c; a decode step over contexts):
* `cpu` (fitted to this CPU's measurements of the tiny model in float32, the solo TTFTs of 2.5K
  and 5K prompts, 1.21 s / 6.26 s, and decode steps of 8 ms + 0.8 ms a request): pass 8 ms +
  0.094 ms x k + context terms, the linear one split half per pass and half per token;
* `production` (8192-token chunks, prompts to 500K): an 8B-class dense model on one H200 from
  first principles, NOT measured (replace with the H200 figures when the GPU platform issue
  lands): 10 ms a pass + 40 us a token (~0.33 s for 8192 tokens at short context) + attention
  1.3 ns x k x c (~5 s for a chunk at 500K context); a decode step 10 ms + 0.1 ms a request +
  27 ns x context token (its 128 KiB of KV read at ~4.8 TB/s);
* `h200` (`--costs h200` with `--scale production`): the same shape fitted to what SGLang on the
  kllm_cuda platform measured on the H200 (8B shape, bf16, Triton attention, CUDA graphs):
  33.2 us a token (30.1K tokens/s prefilling 64 x 512 tokens, results/gpu/run3-speed.json);
  attention 7.81 ns x k x c, least squares over single 32K / 64K / 128K-token prompts chunked
  at 8192 (4.51 / 17.37 / 67.39 s measured, 4.29 / 16.97 / 67.49 s fitted;
  results/incr_prefix/gpu_prefill_gap.json); a decode step 7.5 ms + 0.031 ms a request (batch
  1 / 16 / 64 at 512-token prompts: 7.54 / 9.46 / 10.50 ms per step, run3-speed.json). Not
  measured, kept from `production`: 10 ms of pass overhead and 27 ns per context token of a
  decode step. The Triton attention makes long contexts about 6x costlier than `production`.
Only ratios between policies on the same trace are meant.

    python benchmarks/fair_sched/sim_engine.py --scale cpu --chunk 128      # the CPU grid
    python benchmarks/fair_sched/sim_engine.py --scale production --chunk 8192
    python benchmarks/fair_sched/sim_engine.py --scale production --costs h200 --chunk 8192
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kllm_plugins.bench.stats import quantile  # noqa: E402
from kllm_plugins.plugins.fair_sched.config import FairSchedConfig  # noqa: E402
from kllm_plugins.plugins.fair_sched.core.partial import Candidate, PartialParams, plan_pass  # noqa: E402
from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, QuotaParams, WaitingItem  # noqa: E402
from traces import TraceRequest  # noqa: E402

STOCK = ("fcfs", "shortest-prefill-first", "hrrn")
OURS = ("fair_sched", "fair_multi")


@dataclass(frozen=True)
class Costs:
    base: float
    per_token: float
    ctx_read: float
    attn: float
    attn2: float
    dec_base: float
    dec_row: float
    dec_ctx: float
    dec_ctx2: float = 0.0

    def prefill(self, rows: list[tuple[int, int]]) -> float:
        return self.base + sum(self.per_token * k + self.ctx_read * c + self.attn * k * c + self.attn2 * k * c * c
                               for k, c in rows)

    def decode(self, contexts: list[int]) -> float:
        return self.dec_base + sum(self.dec_row + self.dec_ctx * c + self.dec_ctx2 * c * c for c in contexts)


_CTX = 1.246e-5  # cpu: per context token for a 128-token chunk
COSTS = {
    "cpu": Costs(0.008, 9.4e-5, _CTX * 0.5, _CTX * 0.5 / 128, 1.253e-8 / 128, 0.008, 0.0008,
                 _CTX * 0.5 + _CTX * 0.5 / 128, 1.253e-8 / 128),
    "production": Costs(0.010, 4.0e-5, 0.0, 1.3e-9, 0.0, 0.010, 1.0e-4, 2.7e-8),
    "h200": Costs(0.010, 3.32e-5, 0.0, 7.81e-9, 0.0, 0.0075, 3.1e-5, 2.7e-8),
    # 8 layers of the 8B width on the H100 (sim_h100_8l_check.py): fitted to that run's solo long
    # prompts (24,576 / 40,960 tokens at chunk 2048: 0.737 / 1.891 s) with the H200's 10 ms a pass;
    # a decode step 3.5 ms, fitted to fcfs's mean TPOT on the ten H100 cells at issue 27's loads
    # (sim_decode_fit.py; it was 5.5 ms, fcfs's TPOT on one run, stalls included); per request and
    # per context token a quarter of the H200's (a quarter of the layers)
    "h100_8l": Costs(0.010, 2.86e-6, 0.0, 1.975e-9, 0.0, 0.0035, 7.8e-6, 6.75e-9),
}


@dataclass
class Req:
    rid: int
    arrival: float
    work: int
    out: int
    done: int = 0
    clock: int = 0
    seq: float = 0.0
    tie: float = 0.0
    start_pass: int = -1
    first_s: float = math.nan
    tokens: int = 0
    finish_s: float = math.nan

    @property
    def rem(self) -> int:
        return self.work - self.done


@dataclass
class Engine:
    chunk: int
    cm: Costs
    waiting: list[Req] = field(default_factory=list)
    partial: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    clock: int = 0
    t: float = 0.0
    passes: int = 0
    seen_t: float = 0.0
    """The clock a plugin policy reads when it plans: `t`, or with `overlap` timing the start of
    the pass just run (SGLang's overlap scheduler on a GPU plans pass i+1 when pass i starts)."""
    pool: int | None = None
    """KV pool in tokens (None: no limit). A pass's rows are taken in order while their tokens fit
    beside the KV held by partial, suspended and running requests; a row that does not fit is cut
    to the free tokens if it continues a partial prefill, else left for a later pass (a simplified
    SGLang admission: no reservation for running requests' future tokens, no retraction)."""


def _kv_held(e: Engine, held: list[Req]) -> int:
    """KV tokens held by partial, set-aside (`held`) and running requests."""
    return sum(r.done for r in e.partial + held) + sum(r.work + r.tokens for r in e.running)


def _fit_kv(e: Engine, rows: list[tuple[Req, int]], held: list[Req]) -> list[tuple[Req, int]]:
    """The rows of a pass that the KV pool holds (see `Engine.pool`); `held`: requests set aside."""
    if e.pool is None:
        return rows
    free = e.pool - _kv_held(e, held)
    out = []
    for r, k in rows:
        if k <= free:
            out.append((r, k))
            free -= k
        elif r in e.partial and free > 0:
            out.append((r, free))
            free = 0
        else:
            break
    return out


def _stock_order(e: Engine, policy: str) -> list[Req]:
    if policy == "shortest-prefill-first":
        return sorted(e.waiting, key=lambda r: (r.rem, r.seq))
    if policy == "hrrn":
        return sorted(e.waiting, key=lambda r: (-(e.clock - r.clock) / max(r.rem, 1), r.tie))
    return sorted(e.waiting, key=lambda r: r.seq)


def _spf_limit(chunked: Req, order: list[Req], budget: int) -> int:
    reserved = 0
    for r in order:
        if r.rem >= chunked.rem or reserved + r.rem > budget - 1:
            break
        reserved += r.rem
    return budget - reserved if reserved else budget


def _fill(e: Engine, order: list[Req], rows: list[tuple[Req, int]], budget: int, slot_free: bool) -> None:
    for r in order:
        if budget <= 0:
            break
        if r.rem <= budget:
            rows.append((r, r.rem))
            budget -= r.rem
        elif slot_free:
            rows.append((r, budget))
            budget = 0
            slot_free = False
        else:
            break


class EngineWith(str):
    """A policy's name (a stock order, or `fair_sched`) with engine settings: SGLang's mixed chunk
    (`mixed`, stock orders: `simulate` decodes the running requests inside every prefill pass of
    a policy whose `mixed` is true; fair_sched takes it from `mixed_decode`),
    `--prefill-decode-interval` (`decode_interval`, stock orders: decode rounds after each prefill
    pass before the next prefill), and a decode chunk (`decode_chunk`, with mixed chunk: while
    requests decode a pass prefills at most this many tokens, as Sarathi-Serve's token budget;
    neither SGLang 0.5.23 nor the plugin has it)."""
    mixed = False
    decode_interval = 0
    decode_chunk = 0

    def __new__(cls, name: str, mixed: bool = False, decode_interval: int = 0, decode_chunk: int = 0) -> "EngineWith":
        obj = super().__new__(cls, name)
        obj.mixed, obj.decode_interval, obj.decode_chunk = mixed, decode_interval, decode_chunk
        return obj


def pass_chunk(e: Engine, policy: Any) -> int:
    """This pass's prefill budget: the chunk, or the policy's `decode_chunk` while requests decode
    in mixed passes."""
    d = getattr(policy, "decode_chunk", 0)
    return min(e.chunk, d) if d and e.running and getattr(policy, "mixed", False) else e.chunk


def plan_stock(e: Engine, policy: str) -> list[tuple[Req, int]]:
    rows: list[tuple[Req, int]] = []
    budget = pass_chunk(e, policy)
    order = _stock_order(e, policy)
    slot_free = True
    if e.partial:
        c = e.partial[0]
        cap = _spf_limit(c, order, budget) if policy == "shortest-prefill-first" else budget
        take = min(c.rem, cap)
        rows.append((c, take))
        budget -= take
        slot_free = take == c.rem
    _fill(e, order, rows, budget, slot_free)
    return rows


class FairSingle:
    """The plugin's FairPolicy on SGLang's single partial slot (what the adapter does)."""

    def __init__(self, params: QuotaParams, mixed: bool = False, kv_low_watermark: float = 1.0,
                 decode_chunk: int = 0) -> None:
        self.pol = FairPolicy(params)
        self.suspended: dict[str, Req] = {}
        """Partially prefilled requests set aside (`max_partial_prefills` > 1), by rid."""
        self.mixed = mixed
        """SGLang's mixed chunk (`mixed_decode`): running requests decode one token in every
        prefill pass, each taking one token of the pass budget."""
        self.kv_low_watermark = kv_low_watermark
        """KV usage (of `Engine.pool`) from which no partial request is suspended, as in the adapter."""
        self.decode_chunk = decode_chunk
        """`EngineWith.decode_chunk` (0: none)."""

    def plan(self, e: Engine) -> list[tuple[Req, int]] | None:
        pol, p = self.pol, self.pol.params
        items = [WaitingItem(str(r.rid), r.rem, r.seq, r.clock) for r in e.waiting]
        by_id = {str(r.rid): r for r in e.waiting}
        c = e.partial[0] if e.partial else None
        if pol.active is not None and (c is None or str(c.rid) != pol.active.rid):
            pol.active = None
        if c is None and self.suspended:
            # `max_partial_prefills` > 1: no request is partial, the suspended one with the smallest key resumes
            back = pol.resume()
            c = self.suspended.pop(back.rid) if back is not None else None
            if c is not None:
                e.partial.append(c)
        # mixed chunk: the decode rows take one budget token each, and the policy plans on what is left
        chunk = pass_chunk(e, self)
        budget = max(chunk - len(e.running), 1) if self.mixed else chunk
        # as the adapter: nothing is suspended once KV usage reaches the low watermark, nor for a
        # newcomer whose whole prompt would take it past (a suspended request keeps its KV)
        room = None if e.pool is None else int(self.kv_low_watermark * e.pool) - _kv_held(e, list(self.suspended.values()))
        plan = pol.plan(items, bool(e.running), budget if self.mixed else None, now=e.seen_t,
                        running_reqs=len(e.running), suspend_room=room)
        if plan.action == "yield" and plan.yield_to == "decode":
            return None
        suspending = plan.action == "yield" and plan.yield_to == "partial"
        if suspending and c is not None:
            # it keeps its progress (KV) aside; this pass may truncate the earlier-key newcomer
            e.partial.remove(c)
            self.suspended[str(c.rid)] = c
            c = None
        if plan.action == "admit":
            plan = None
        rows: list[tuple[Req, int]] = []
        parked = plan is not None and plan.action == "yield" and not suspending
        # with requests suspended, a new partial prefill starts only on the pass planned for it
        slot_free = c is None and (suspending or not self.suspended)
        if c is not None and not parked:
            cap = budget if plan is None or plan.long_limit is None else min(budget, plan.long_limit)
            take = min(c.rem, cap)
            rows.append((c, take))
            budget -= take
            # as the adapter (_refuse_second_truncation): while a request is suspended, none is
            # truncated into a new partial prefill, not even where this one ends in the pass
            slot_free = take == c.rem and not self.suspended
        if plan is not None:
            budget += plan.extra_tokens
        order = [by_id[items[i].rid] for i in pol.order(items)]
        _fill(e, order, rows, budget, slot_free and not parked)
        return rows

    def observe(self, rows: list[tuple[Req, int]]) -> None:
        pol = self.pol
        pol.note_prefill()
        for r, k in rows:
            rid = str(r.rid)
            if pol.active is not None and pol.active.rid == rid:
                pol.record_run(rid, k)
                if r.rem == 0:
                    pol.finish_long(rid)
            elif r.rem > 0:
                pol.start_long(rid, r.rem + k)
                pol.record_run(rid, k)

    def note_decode(self, t: float) -> None:
        self.pol.note_decode(t)


class FairMulti:
    """The plugin's order with several partial prefills (core/partial.py); decode steps decided
    by a FairPolicy with the same options (it never has an active request here)."""

    def __init__(self, pp: PartialParams, qp: QuotaParams) -> None:
        self.pp, self.pol = pp, FairPolicy(qp)

    def plan(self, e: Engine) -> list[tuple[Req, int]] | None:
        if self.pol.plan([], bool(e.running), now=e.seen_t, running_reqs=len(e.running)).action == "yield":
            return None
        cands = [Candidate(str(r.rid), r.rem, r.clock, r.seq, r.work, r in e.partial) for r in e.partial + e.waiting]
        by_id = {str(r.rid): r for r in e.partial + e.waiting}
        return [(by_id[rid], k) for rid, k in plan_pass(cands, self.pp)]

    def observe(self, rows: list[tuple[Req, int]]) -> None:
        self.pol.note_prefill()

    def note_decode(self, t: float) -> None:
        self.pol.note_decode(t)


def make_policy(name: str, chunk: int, cfg: FairSchedConfig, max_partial: int = 4) -> Any:
    if name in STOCK:
        return name
    qp = cfg.quota_params(chunk)
    if name == "fair_sched":
        return FairSingle(qp, cfg.mixed_decode, cfg.kv_low_watermark, getattr(name, "decode_chunk", 0))
    pp = PartialParams(chunk, qp.short_extra_tokens, max_partial, 1, 0, qp.age_weight)
    return FairMulti(pp, qp)


def _decode_one_token(e: Engine) -> int:
    """Every running request gains one output token; returns how many finished."""
    done = 0
    for r in list(e.running):
        r.tokens += 1
        if r.tokens >= r.out:
            r.finish_s = e.t
            e.running.remove(r)
            done += 1
    return done


def simulate(trace: list[TraceRequest], rate: float, policy: Any, chunk: int, cm: Costs, seed: int = 0,
             overlap: bool = False, pool_tokens: int | None = None) -> list[Req]:
    """Run `trace` (1 req/s timestamps) at `rate` req/s (0: all at once); return the requests.
    `overlap`: the policy reads the clock as under SGLang's overlap scheduler on a GPU (Engine.seen_t).
    `pool_tokens`: a KV pool of that many tokens (`Engine.pool`; default none)."""
    tie = random.Random(seed)
    reqs = [Req(i, (x.arrival_s / rate) if rate > 0 else 0.0, x.input_len, x.output_len, seq=i, tie=tie.random())
            for i, x in enumerate(trace)]
    e = Engine(chunk, cm, pool=pool_tokens)
    nxt = finished = 0
    began = 0.0  # when the last pass started
    replans = 0  # passes in a row whose planned rows the KV pool could not hold, nothing running
    interval = int(getattr(policy, "decode_interval", 0) or 0)  # SGLang's --prefill-decode-interval
    deferred = 0  # decode rounds still owed before the next prefill
    while finished < len(reqs):
        while nxt < len(reqs) and reqs[nxt].arrival <= e.t:
            reqs[nxt].clock = e.clock
            e.waiting.append(reqs[nxt])
            nxt += 1
        if not e.waiting and not e.partial and not e.running and not getattr(policy, "suspended", None):
            e.t = began = reqs[nxt].arrival
            continue
        e.seen_t = began if overlap else e.t
        # SGLang's _should_defer_prefill: no prefill is planned this round, the running requests decode
        defer = bool(deferred and e.running)
        deferred = deferred - 1 if defer else 0
        rows = [] if defer else plan_stock(e, policy) if isinstance(policy, str) else policy.plan(e)
        planned = bool(rows)
        if rows and e.pool is not None:
            rows = _fit_kv(e, rows, list(getattr(policy, "suspended", {}).values()))
        began = e.t
        if planned and not rows and not e.running and replans < 8:
            # a yield to earlier-key requests the free KV cannot hold: SGLang's adder admits none,
            # the pass is empty and the scheduler plans again at once (the yield is spent, so the
            # partial request runs next); not a stall
            replans += 1
            continue
        replans = 0
        if rows:
            e.t += cm.prefill([(k, r.done) for r, k in rows])
            if getattr(policy, "mixed", False) and e.running:
                # mixed chunk: the running requests decode one token inside this pass
                e.t += cm.decode([r.work + r.tokens for r in e.running]) - cm.dec_base
                finished += _decode_one_token(e)
            e.passes += 1
            deferred = interval
            for r, k in rows:
                if r.start_pass < 0:
                    r.start_pass = e.passes
                r.done += k
                e.clock += k
                if r in e.waiting:
                    e.waiting.remove(r)
                if r.rem == 0:
                    if r in e.partial:
                        e.partial.remove(r)
                    r.first_s, r.tokens = e.t, 1
                    if r.out <= 1:
                        r.finish_s = e.t
                        finished += 1
                    else:
                        e.running.append(r)
                elif r not in e.partial:
                    e.partial.append(r)
            if not isinstance(policy, str):
                policy.observe(rows)
        elif e.running:
            if not isinstance(policy, str):
                policy.note_decode(e.seen_t)
            e.t += cm.decode([r.work + r.tokens for r in e.running])
            finished += _decode_one_token(e)
        elif nxt < len(reqs):
            e.t = began = max(e.t, reqs[nxt].arrival)
        else:
            raise RuntimeError(f"stuck: {len(e.waiting)} waiting, {len(e.partial)} partial")
    return reqs


def pct(xs: list[float], q: float) -> float:
    return quantile(xs, q)  # the harness's (numpy.percentile's linear method)


def summary(reqs: list[Req], long_tokens: int) -> dict[str, float]:
    ttft = [r.first_s - r.arrival for r in reqs]
    short = [r.first_s - r.arrival for r in reqs if r.work <= long_tokens]
    long_ = [r.first_s - r.arrival for r in reqs if r.work > long_tokens]
    tpot = [(r.finish_s - r.first_s) / (r.out - 1) for r in reqs if r.out > 1]
    return {"mean": statistics.fmean(ttft), "p90": pct(ttft, 0.9), "p99": pct(ttft, 0.99),
            "short_p90": pct(short, 0.9) if short else math.nan,
            "long_mean": statistics.fmean(long_) if long_ else math.nan,
            "tpot": statistics.fmean(tpot) if tpot else math.nan,  # none: every output one token
            "throughput": len(reqs) / (max(r.finish_s for r in reqs) - min(r.arrival for r in reqs)),
            # end to end (arrival to last token) and its decode part (first token to last), means
            "e2e": statistics.fmean(r.finish_s - r.arrival for r in reqs),
            "decode": statistics.fmean(r.finish_s - r.first_s for r in reqs)}


def capacity(trace: list[TraceRequest], chunk: int, cm: Costs, pool_tokens: int | None = None) -> float:
    """Saturated fcfs throughput of a burst of the trace (the real harness measures it the same way)."""
    reqs = simulate(trace, 0.0, "fcfs", chunk, cm, pool_tokens=pool_tokens)
    return len(reqs) / max(r.finish_s for r in reqs)


def main() -> None:
    import grid

    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=("cpu", "production"), default="cpu")
    ap.add_argument("--costs", choices=tuple(COSTS), default="", help="cost model (default: the scale's own)")
    ap.add_argument("--chunk", type=int, default=0, help="0: the scale's chunk (128 / 8192)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--fair-env", nargs="*", default=[], help="option=value for the plugin's config")
    ap.add_argument("--out", default="", help="results JSON (default: benchmarks/results/fair_sched_sim_<scale>_<chunk>.json)")
    args = ap.parse_args()
    grid.run_sim_grid(args)


if __name__ == "__main__":
    main()
