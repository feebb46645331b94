"""SIMULATION: instance-seconds at equal SLO attainment, cold starts against a warm standby pool.

The time-stepped model and shifting trace of `bench_scaling_sim.py` (decode-heavy,
prefill-heavy, quiet) with the plugin's controller (`PoolDecider`), fed the time-to-serve
measured on this CPU by `bench_time_to_serve.py` (SmolLM2-135M: cold start, from decision to the
first routed request; standby promotion, likewise), read from its results file unless given.
Two families, each swept over the pools' Load target (`up_load`) and the prefill pool's minimum:
"cold" adds instances by cold start only; "standby" keeps warm standbys (prefill only, or one
per pool), which count in the instance-seconds for all the time they exist (a standby holds its
memory; on a GPU it would hold its device). For each attainment level, the cheapest
configuration of each family reaching it on the training seeds, measured on held-out seeds.

    python benchmarks/bigpd_router/bench_scaling_standby_sim.py
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from bench_scaling_frontier import TUNED  # noqa: E402
from bench_scaling_sim import Req, simulate, trace  # noqa: E402

from kllm_plugins.bench.record import build_summary, result_path, write_summary  # noqa: E402
from kllm_plugins.plugins.bigpd_router.core.registry import Role  # noqa: E402

LEVELS = [0.95, 0.98, 0.99, 0.995]
BIN_S = 10.0
BIN_SLO = 0.9
"""A `BIN_S` bin of arrivals whose attainment is below `BIN_SLO` is part of the violation window."""


def measured(model: str = "smollm2") -> tuple[float, float, str]:
    """(cold s, promotion s, source): the medians recorded by bench_time_to_serve.py for `model`."""
    tts = result_path("bigpd_router", "time_to_serve")
    data = json.loads(tts.read_text(encoding="utf-8"))
    found: dict[str, tuple[float, str]] = {}
    for run in data.get("runs", []):  # the layout before results/<plugin>/<name>.json; later runs win
        for path in ("cold", "standby"):
            s = run.get("summary", {}).get(model, {}).get(path)
            if s:
                found[path] = (s["decision_to_served_s"]["median"], f"{run['date_utc']} commit {run['commit']}")
    for path in ("cold", "standby"):
        s = (data.get("metrics") or {}).get(model, {}).get(path)
        if s:
            run = s.get("run") or {}
            found[path] = (s["decision_to_served_s"]["median"], f"{run.get('date')} commit {run.get('commit')}")
    if len(found) < 2:
        raise SystemExit(f"no {model} cold and standby figures in {tts}: run bench_time_to_serve.py or give --cold-s")
    return (found["cold"][0], found["standby"][0],
            f"results/bigpd_router/time_to_serve.json, {model} medians: cold {found['cold'][1]}, "
            f"standby {found['standby'][1]}")


def configs(up_loads: list[float], min_prefill: list[int]) -> list[dict[str, Any]]:
    out = []
    for family, sizes in (("cold", [{}]), ("standby", [{Role.PREFILL: 1}, {Role.PREFILL: 1, Role.DECODE: 1}])):
        for size in sizes:
            for up in up_loads:
                for mp in min_prefill:
                    pol = dataclasses.replace(TUNED, up_load=up)
                    tag = "" if not size else " standby " + "+".join(f"{n}{r.value[0].upper()}" for r, n in size.items())
                    out.append({"family": family, "standby": size, "up_load": up, "min_prefill": mp,
                                "name": f"{family} up {up} minP {mp}{tag}",
                                "policy": {Role.PREFILL: dataclasses.replace(pol, min_instances=mp), Role.DECODE: pol}})
    return out


def run_config(cfg: dict[str, Any], seeds: list[int], cold_s: float, promote_s: float,
               duration: float) -> dict[str, float]:
    att, ins, sb, win = [], [], [], []
    for seed in seeds:
        reqs = trace(seed, duration)
        r = simulate([Req(x.t, x.inp, x.out, left=x.inp) for x in reqs], "pools", 0, cold_s, cfg["policy"],
                     initial=3, standby=cfg["standby"], promote_delay=promote_s)
        att.append(r["slo_attainment"])
        ins.append(r["instance_seconds"])
        sb.append(r["standby_seconds"])
        win.append(violation_window_s([x.t for x in reqs], r["missed_at"]))
    return {"attainment": round(statistics.mean(att), 4), "worst": round(min(att), 4),
            "instance_seconds": round(statistics.mean(ins), 1), "standby_seconds": round(statistics.mean(sb), 1),
            "violation_window_s": round(statistics.mean(win), 1)}


def violation_window_s(arrivals: list[float], missed_at: list[float]) -> float:
    """Seconds of `BIN_S` bins of arrivals whose attainment is below `BIN_SLO`."""
    total: collections.Counter[int] = collections.Counter(int(t // BIN_S) for t in arrivals)
    missed: collections.Counter[int] = collections.Counter(int(t // BIN_S) for t in missed_at)
    return BIN_S * sum(1 for b, n in total.items() if (n - missed[b]) / n < BIN_SLO)


def cost(r: dict[str, float], standby_cost: float) -> float:
    """Instance-seconds with a ready standby's second weighted by `standby_cost` (1: a standby
    costs what a serving instance costs; less: several standbys with released memory share a device)."""
    return r["instance_seconds"] - (1.0 - standby_cost) * r["standby_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold-s", type=float, help="cold start, decision to first request served (default: measured)")
    ap.add_argument("--promote-s", type=float, help="standby promotion, likewise (default: measured)")
    ap.add_argument("--train-seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--test-seeds", type=int, nargs="+", default=[4, 5, 6])
    ap.add_argument("--up-loads", type=float, nargs="+", default=[0.9, 1.2])
    ap.add_argument("--min-prefill", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--duration-s", type=float, default=900.0)
    ap.add_argument("--extra-cold-s", type=float, nargs="*", default=[600.0],
                    help="further cold-start times to simulate (600: the issue's ~10 min GPU start, NOT measured here)")
    ap.add_argument("--standby-costs", type=float, nargs="+", default=[1.0, 0.25],
                    help="weight of a ready standby's instance-second (1: full; 0.25: four released standbys per device)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.cold_s is None or args.promote_s is None:
        cold, promote, source = measured()
        cold = args.cold_s if args.cold_s is not None else cold
        promote = args.promote_s if args.promote_s is not None else promote
    else:
        cold, promote, source = args.cold_s, args.promote_s, "given on the command line"
    scenarios = [(cold, f"measured on this CPU: {source}")] + [(c, "assumed, not measured") for c in args.extra_cold_s]
    rows, table, pairs = [], [], []
    for cold_s, label in scenarios:
        print(f"SIMULATION: cold start {cold_s:.1f} s ({label}), standby promotion {promote:.2f} s")
        for cfg in configs(args.up_loads, args.min_prefill):
            train = run_config(cfg, args.train_seeds, cold_s, promote, args.duration_s)
            test = run_config(cfg, args.test_seeds, cold_s, promote, args.duration_s)
            rows.append({"cold_s": cold_s, "name": cfg["name"], "family": cfg["family"], "up_load": cfg["up_load"],
                         "min_prefill": cfg["min_prefill"], "standby": {r.value: n for r, n in cfg["standby"].items()},
                         "train": train, "test": test})
            print(json.dumps(rows[-1]), flush=True)
        for w in args.standby_costs:
            print(f"\nSIMULATION cold {cold_s:.0f} s, standby cost {w}: level | cold: config, held-out attainment "
                  "(worst) / instance-s | standby: same | standby/cold instance-s")
            for level in LEVELS:
                pick = {}
                for fam in ("cold", "standby"):
                    ok = [r for r in rows if r["cold_s"] == cold_s and r["family"] == fam
                          and r["train"]["attainment"] >= level]
                    pick[fam] = min(ok, key=lambda r: cost(r["train"], w)) if ok else None
                c, s = pick["cold"], pick["standby"]
                ratio = round(cost(s["test"], w) / cost(c["test"], w), 3) if c and s else None
                table.append({"cold_s": cold_s, "cold_source": label, "standby_cost": w, "level": level,
                              "cold": c and {"name": c["name"], **c["test"], "cost": cost(c["test"], w)},
                              "standby": s and {"name": s["name"], **s["test"], "cost": cost(s["test"], w)},
                              "standby_over_cold": ratio})

                def cell(r: dict[str, Any] | None) -> str:
                    if r is None:
                        return "not reached"
                    return (f"{r['name']}: {r['test']['attainment']:.4f} ({r['test']['worst']:.4f}) / "
                            f"{cost(r['test'], w):.0f}")

                print(f"            {level} | {cell(c)} | {cell(s)} | {ratio}")
        same = same_config(rows, cold_s)
        pairs.extend(same)
        print(f"\nSIMULATION cold {cold_s:.0f} s, same serving config (held-out seeds): config | cold: attainment, "
              f"violation window s, instance-s | standby pool: attainment, window s, instance-s (idle s) | "
              f"window saved s per idle instance-s")
        for p in same:
            c, sb = p["cold"], p["standby"]
            print(f"  up {p['up_load']} minP {p['min_prefill']} {p['standby_pool']:<6} | {c['attainment']:.4f} "
                  f"{c['violation_window_s']:>6.0f} {c['instance_seconds']:>7.0f} | {sb['attainment']:.4f} "
                  f"{sb['violation_window_s']:>6.0f} {sb['instance_seconds']:>7.0f} ({sb['standby_seconds']:.0f}) | "
                  f"{p['window_saved_s_per_idle_s']}")
    if args.no_record:
        return
    metrics = {"time_to_serve": {"cold_s": cold, "promote_s": promote, "source": source,
                                 "extra_cold_s_assumed": args.extra_cold_s},
               "same_serving_config": pairs, "at_equal_attainment": table}
    path = write_summary(result_path("bigpd_router", "standby_sim"), build_summary(
        " ".join(["python", *sys.argv]), metrics, machine="any (deterministic simulation)", simulated=True,
        notes="SIMULATION (bench_scaling_sim.py's model) fed the time-to-serve measured on this CPU. "
              "same_serving_config: each controller configuration with and without a standby pool: the pool's price "
              "is its idle instance-seconds (bounded: pool size x trace length), what it buys is a shorter "
              f"violation window ({BIN_S:.0f} s bins of arrivals under {BIN_SLO} attainment). at_equal_attainment: "
              "the cheapest configuration of each family reaching a level; a standby costed as a serving instance "
              "(standby_cost 1) never wins there, because the same instance-seconds spent on a higher pool minimum "
              "serve at once instead of after a promotion.",
        train_seeds=args.train_seeds, test_seeds=args.test_seeds, configs=rows))
    print(f"recorded {path}")


def same_config(rows: list[dict[str, Any]], cold_s: float) -> list[dict[str, Any]]:
    """Held-out figures of each (up_load, min_prefill) without a pool against each pool size."""
    out = []
    sel = [r for r in rows if r["cold_s"] == cold_s]
    for c in (r for r in sel if r["family"] == "cold"):
        for sb in (r for r in sel if r["family"] == "standby" and r["up_load"] == c["up_load"]
                   and r["min_prefill"] == c["min_prefill"]):
            idle = sb["test"]["standby_seconds"]
            saved = c["test"]["violation_window_s"] - sb["test"]["violation_window_s"]
            keep = ("attainment", "violation_window_s", "instance_seconds", "standby_seconds")
            out.append({"cold_s": cold_s, "up_load": c["up_load"], "min_prefill": c["min_prefill"],
                        "standby_pool": "+".join(f"{n}{k[0].upper()}" for k, n in sb["standby"].items()),
                        "cold": {k: c["test"][k] for k in keep}, "standby": {k: sb["test"][k] for k in keep},
                        "window_saved_s": round(saved, 1),
                        "extra_instance_seconds": round(sb["test"]["instance_seconds"] - c["test"]["instance_seconds"], 1),
                        "window_saved_s_per_idle_s": round(saved / idle, 3) if idle else None})
    return out

if __name__ == "__main__":
    main()
