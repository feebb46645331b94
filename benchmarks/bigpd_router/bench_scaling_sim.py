"""Scaling on a shifting trace: fixed xPyD groups against global pools with the controller.

SIMULATION (clearly labelled): a time-stepped model of prefill instances (FIFO, fixed token
rate) and decode instances (batched; TPOT grows with the batch), fed a trace whose
input/output mix shifts from decode-heavy to prefill-heavy and back. The pools setup uses the
plugin's own controller logic (`PoolDecider` with SLO Load = max(pred, actual) / target) and
pays a start-up delay per added instance; the fixed setup scales nothing. Reports SLO
attainment (TTFT and TPOT both within target) and instance-seconds.

    python benchmarks/bigpd_router/bench_scaling_sim.py --groups 2 3 4
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from kllm_plugins.bench import trace as bench_trace
from kllm_plugins.plugins.bigpd_router.core.registry import Role
from kllm_plugins.plugins.bigpd_router.core.scaling import PoolDecider, ScalePolicy
from kllm_plugins.plugins.bigpd_router.core.slo_load import PoolLoad

PREFILL_TOK_S = 8000.0   # prompt tokens per second per prefill instance
TPOT0 = 0.02             # seconds per token of a lone decode request
KNEE = 16.0              # batch size that doubles the decode step
TTFT_TARGET = 2.0
TPOT_TARGET = 0.05
DT = 0.05


@dataclass
class Req:
    t: float
    inp: int
    out: int
    done_prefill: float | None = None
    done: float | None = None
    made: float = 0.0
    left: int = 0


@dataclass
class Inst:
    role: Role
    ready_at: float
    queue: collections.deque = field(default_factory=collections.deque)  # type: ignore[type-arg]
    batch: list[Req] = field(default_factory=list)
    draining: bool = False
    group: int = -1
    switch_to: Role | None = None

    def backlog(self) -> int:
        return sum(r.left for r in self.queue)


def trace(seed: int, duration: float) -> list[Req]:
    """Three phases: chat-like (short in, long out), document-like (long in, short out), mixed and quieter."""
    rng = random.Random(seed)
    out: list[Req] = []
    t = 0.0
    while t < duration:
        phase = int(3 * t / duration)
        rate = (6.0, 3.0, 2.0)[phase]
        t += rng.expovariate(rate)
        if phase == 0:
            inp, o = rng.randint(200, 800), rng.randint(100, 300)
        elif phase == 1:
            inp, o = rng.randint(2000, 6000), rng.randint(10, 40)
        else:
            inp, o = rng.randint(500, 2000), rng.randint(50, 150)
        out.append(Req(t, inp, o, left=inp))
    return out


def to_records(reqs: list[Req]) -> list[bench_trace.TraceRecord]:
    """The trace in the harness's one format (Mooncake records; no prefix sharing: empty hash_ids)."""
    return [bench_trace.TraceRecord(round(r.t * 1000.0, 3), r.inp, r.out, ()) for r in reqs]


def from_records(records: list[bench_trace.TraceRecord]) -> list[Req]:
    """Requests of a Mooncake trace at its own arrivals (its timestamps are ms from the trace start)."""
    return [Req(r.arrival_s, r.input_length, r.output_length, left=r.input_length) for r in records]


def simulate(reqs: list[Req], setup: str, groups: int, start_delay: float,
             policy: ScalePolicy | dict[Role, ScalePolicy],
             initial: int | tuple[int, int] = 2, interval: float = 5.0, role_switch: bool = False,
             switch_delay: float = 2.0, shape: tuple[int, int] = (1, 1), standby: int | dict[Role, int] = 0,
             promote_delay: float = 0.5) -> dict[str, Any]:
    """One run. fixed: `groups` groups of shape xPyD, a request stays inside its group; pools:
    `initial` prefill and decode instances (an int or (P, D)), scaled by the controller with
    `policy` (one for both pools or one per pool). `standby` warm instances per pool (pools only):
    a scale-up takes one (serving after `promote_delay`) before starting one cold (`start_delay`),
    a promoted one is replaced by a cold start in the background, a drained one goes back to a
    short pool; standby and refilling instances count in the instance-seconds."""
    insts: list[Inst] = []
    if setup == "fixed":
        for g in range(groups):
            insts += [Inst(Role.PREFILL, 0.0, group=g) for _ in range(shape[0])]
            insts += [Inst(Role.DECODE, 0.0, group=g) for _ in range(shape[1])]
    else:
        n_p, n_d = (initial, initial) if isinstance(initial, int) else initial
        insts += [Inst(Role.PREFILL, 0.0) for _ in range(n_p)]
        insts += [Inst(Role.DECODE, 0.0) for _ in range(n_d)]
    policies = policy if isinstance(policy, dict) else {Role.PREFILL: policy, Role.DECODE: policy}
    deciders = {r: PoolDecider(r, policies[r]) for r in (Role.PREFILL, Role.DECODE)}
    ttft_recent: dict[Role, collections.deque] = {r: collections.deque() for r in Role}  # type: ignore[type-arg]
    pending = collections.deque(sorted(reqs, key=lambda r: r.t))
    now, inst_seconds, next_ctl = 0.0, 0.0, 0.0
    end = reqs[-1].t + 120.0
    timeline: list[tuple[float, int, int]] = []
    size = standby if isinstance(standby, dict) else {Role.PREFILL: standby, Role.DECODE: standby}
    spare = {r: size.get(r, 0) for r in (Role.PREFILL, Role.DECODE)} if setup == "pools" else {}
    """Ready standbys per pool."""
    refills: list[tuple[float, Role]] = []
    """Standbys starting cold to replace promoted ones: (ready at, pool)."""
    promoted = cold_starts = 0
    standby_seconds = 0.0
    while now < end and (pending or any(i.queue or i.batch for i in insts)):
        live = [i for i in insts if i.ready_at <= now]
        while pending and pending[0].t <= now:
            r = pending.popleft()
            pre = [i for i in live if i.role is Role.PREFILL and not i.draining]
            if setup == "fixed":
                # a fair group router: least prefill backlog per prefill instance, then least decode batch
                g = min(range(groups), key=lambda g: (sum(i.backlog() for i in pre if i.group == g) / shape[0],
                                                      sum(len(i.batch) for i in live if i.group == g) / shape[1]))
                target = min((i for i in pre if i.group == g), key=lambda i: i.backlog())
            else:
                target = min(pre, key=lambda i: i.backlog())
            target.queue.append(r)
        for i in live:
            if i.role is Role.PREFILL:
                budget = PREFILL_TOK_S * DT
                while i.queue and budget > 0:
                    r = i.queue[0]
                    step = min(budget, r.left)
                    r.left -= int(step) if step < r.left else r.left
                    budget -= step
                    if r.left <= 0:
                        i.queue.popleft()
                        r.done_prefill = now
                        ttft_recent[Role.PREFILL].append((now, now - r.t))
                        dec = [d for d in live if d.role is Role.DECODE and not d.draining and
                               (setup != "fixed" or d.group == i.group)]
                        min(dec, key=lambda d: len(d.batch)).batch.append(r)
            else:
                if i.batch:
                    tpot = TPOT0 * (1 + len(i.batch) / KNEE)
                    for r in list(i.batch):
                        r.made += DT / tpot
                        if r.made >= r.out:
                            r.done = now
                            i.batch.remove(r)
        inst_seconds += DT * (len(insts) + sum(spare.values()) + len(refills))  # starting and standby ones cost too
        standby_seconds += DT * sum(spare.values())
        for at, role in [x for x in refills if x[0] <= now]:
            refills.remove((at, role))
            spare[role] += 1
        if setup == "pools" and now >= next_ctl:
            next_ctl = now + interval
            q = ttft_recent[Role.PREFILL]
            while q and q[0][0] < now - 30:
                q.popleft()

            def pool(role: Role) -> tuple[list[Inst], PoolLoad]:
                # starting instances (and those switching in) count, with no work yet, as in the router
                members = [i for i in insts if (i.role is role and not i.draining) or i.switch_to is role]
                if role is Role.PREFILL:
                    pred = sum(i.backlog() + 2000 for i in members) / len(members) / PREFILL_TOK_S
                    actual = sum(v for _, v in q) / len(q) if q else 0.0
                    return members, PoolLoad(pred, actual, TTFT_TARGET, len(members), floor=2000 / PREFILL_TOK_S)
                pred = sum(TPOT0 * (1 + (len(i.batch) + 1) / KNEE) for i in members) / len(members)
                return members, PoolLoad(pred, 0.0, TPOT_TARGET, len(members), floor=TPOT0 * (1 + 1 / KNEE))

            for role in (Role.PREFILL, Role.DECODE):
                members, load = pool(role)
                d = deciders[role].decide(load, len(members), now)
                if d.action == "up":
                    other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
                    lent = 0
                    while role_switch and lent < d.count:
                        o_members, o_load = pool(other)
                        idle = [i for i in o_members if i.ready_at <= now and i.switch_to is None]
                        if not idle or not deciders[other].spare(o_load, len(o_members)):
                            break
                        victim = min(idle, key=lambda i: len(i.batch) + len(i.queue))
                        victim.draining, victim.switch_to = True, role  # drains, then flips (below)
                        lent += 1
                    for _ in range(d.count - lent):
                        if spare.get(role, 0) > 0:
                            spare[role] -= 1
                            refills.append((now + start_delay, role))
                            insts.append(Inst(role, now + promote_delay))
                            promoted += 1
                        else:
                            insts.append(Inst(role, now + start_delay))
                            cold_starts += 1
                elif d.action == "down":
                    starting = [i for i in members if i.ready_at > now and i.switch_to is None]
                    if starting:  # as the router's pick_victim: a starting instance goes first
                        insts.remove(starting[-1])
                        continue
                    victim = min((i for i in members if i.ready_at <= now and i.switch_to is None),
                                 key=lambda i: len(i.batch) + len(i.queue))
                    victim.draining = True
            for i in insts:  # a drained instance that is switching joins the other pool after the flip
                if i.switch_to is not None and not i.queue and not i.batch:
                    i.role, i.switch_to, i.draining, i.ready_at = i.switch_to, None, False, now + switch_delay
            gone = [i for i in insts if i.draining and i.switch_to is None and not i.queue and not i.batch]
            for i in gone:  # a drained instance goes back to a short standby pool, else it stops
                if spare and spare[i.role] + sum(1 for _, r in refills if r is i.role) < size.get(i.role, 0):
                    spare[i.role] += 1
            insts = [i for i in insts if not (i.draining and i.switch_to is None and not i.queue and not i.batch)]
        timeline.append((now, sum(1 for i in insts if i.role is Role.PREFILL),
                         sum(1 for i in insts if i.role is Role.DECODE)))
        now += DT
    ok = 0
    missed: list[float] = []
    for r in reqs:
        good = False
        if r.done is not None and r.done_prefill is not None:
            ttft = r.done_prefill - r.t
            tpot = (r.done - r.done_prefill) / max(1, r.out - 1)
            good = ttft <= TTFT_TARGET and tpot <= TPOT_TARGET
        ok += good
        if not good:
            missed.append(round(r.t, 1))
    peak = max(p + d for _, p, d in timeline)
    return {"setup": setup, "simulated": True, "groups": groups if setup == "fixed" else None,
            "shape": f"{shape[0]}P{shape[1]}D" if setup == "fixed" else None,
            "slo_attainment": round(ok / len(reqs), 4), "instance_seconds": round(inst_seconds, 1),
            "peak_instances": peak, "missed_at": missed, "timeline": timeline[::100],
            "standby": {r.value: n for r, n in size.items()} if isinstance(standby, dict) else standby,
            "promoted": promoted, "cold_starts": cold_starts, "standby_seconds": round(standby_seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--duration-s", type=float, default=900.0)
    ap.add_argument("--start-delay-s", type=float, default=10.0)
    # the policy below was chosen on seeds 1-3 (a small grid over up_load, sustain, cool-down, minimum);
    # the default seeds 4-9 were not looked at while choosing it
    ap.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6, 7, 8, 9])
    ap.add_argument("--up-load", type=float, default=0.75)
    ap.add_argument("--down-load", type=float, default=0.3)
    ap.add_argument("--up-sustain-s", type=float, default=5.0)
    ap.add_argument("--cooldown-s", type=float, default=20.0)
    ap.add_argument("--min-instances", type=int, default=2)
    ap.add_argument("--urgent-load", type=float, default=1.5)
    ap.add_argument("--initial", type=int, default=3, help="pool sizes at t=0 (3 = the 3x(1P1D) start)")
    ap.add_argument("--interval-s", type=float, default=5.0, help="controller period")
    ap.add_argument("--role-switch", action="store_true",
                    help="pools lend idle instances to each other (SGLang /pd_role_switch) before starting new ones")
    ap.add_argument("--switch-delay-s", type=float, default=2.0, help="time a drained instance takes to flip")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--trace-file", default="",
                    help="replay this Mooncake JSONL trace (e.g. one sglang.bench_serving reads) for every seed "
                         "instead of the synthetic one")
    ap.add_argument("--write-trace", default="", help="write each seed's synthetic trace here, {seed} in the name")
    args = ap.parse_args()
    policy = ScalePolicy(up_load=args.up_load, down_load=args.down_load, up_sustain_s=args.up_sustain_s,
                         down_sustain_s=60, cooldown_s=args.cooldown_s, min_instances=args.min_instances,
                         max_instances=8, drain_timeout_s=120, urgent_load=args.urgent_load)
    rows = []
    replayed = from_records(bench_trace.read_trace(args.trace_file)) if args.trace_file else None
    for seed in args.seeds:
        reqs = replayed if replayed is not None else trace(seed, args.duration_s)
        if args.write_trace and replayed is None:
            bench_trace.write_trace(args.write_trace.format(seed=seed), to_records(reqs))
        for g in args.groups:
            rows.append(dict(simulate([Req(r.t, r.inp, r.out, left=r.inp) for r in reqs], "fixed", g,
                                      args.start_delay_s, policy), seed=seed))
        rows.append(dict(simulate([Req(r.t, r.inp, r.out, left=r.inp) for r in reqs], "pools", 0,
                                  args.start_delay_s, policy, initial=args.initial, interval=args.interval_s,
                                  role_switch=args.role_switch, switch_delay=args.switch_delay_s),
                         seed=seed))
        for r in rows[-len(args.groups) - 1:]:
            r.pop("missed_at"), r.pop("timeline")
            print(json.dumps(r))
    print("\nSIMULATION  setup              SLO attainment (mean, min)  instance-seconds (mean)")
    keys = [("fixed", g) for g in args.groups] + [("pools", None)]
    summary = []
    for setup, g in keys:
        sel = [r for r in rows if r["setup"] == setup and r["groups"] == g]
        att = [r["slo_attainment"] for r in sel]
        ins = [r["instance_seconds"] for r in sel]
        name = f"fixed {g}x(1P1D)" if setup == "fixed" else "pools+controller"
        line = f"{name} {sum(att) / len(att):.4f} (min {min(att):.4f}) / {sum(ins) / len(ins):.0f}"
        summary.append(line)
        print(f"            {name:<18} {sum(att) / len(att):>8.4f} ({min(att):.4f})        {sum(ins) / len(ins):>10.0f}")
    if args.no_record:
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from loadgen import merge_results

    command = " ".join(["python", *sys.argv])
    merge_results("scaling", rows, command, keep=lambda r: not r.get("simulated") or r.get("sweep"))
    # the summary line (benchmarks/RESULTS.md is generated from the results files)
    print(f"| bigpd_router | SIMULATION: shifting trace (decode-heavy, prefill-heavy, quiet; "
          f"{args.duration_s:.0f} s), seeds {args.seeds} (held out from the policy choice), "
          f"{args.start_delay_s:.0f} s instance start, pools start at {args.initial}P+{args.initial}D | "
          f"SLO attainment (mean, min) / instance-seconds (mean): {'; '.join(summary)} | `{command}` |")


if __name__ == "__main__":
    main()
