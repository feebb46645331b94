"""Benchmark (not collected by pytest): does one huge prompt in flight hold every other prefill back?
(issue 27). Stock SGLang policies vs fair_sched on real CPU SGLang servers with the tiny model.

Workload per seed: one long prompt of `--long-tokens` (default 7900; the model's context is 8192)
with `--long-out` output tokens is sent at t=0. From `--lead-s` on, while it prefills, `--shorts`
short prompts (32-256 tokens, 1-2 chunks at chunk 128) arrive as a Poisson process at `--rate`
per second, and `--mediums` medium prompts (600-1500 tokens, more than one pass) at uniform times
over the same span (`--short-len`, `--medium-len` change the ranges). Shorts and mediums ask 8-16 output tokens. All greedy (temperature 0,
ignore_eos) on a float32 model; token ids in 10..3900 from a seeded rng, sent to /generate as
`input_ids` and streamed (TTFT = time to the first event).

Setups (`--setups`): stock `fcfs`, `lpm`, `shortest-prefill-first`, `hrrn`, and `fair_sched`
(policy fcfs, plugin defaults); `--variant TAG:KEY=V[,KEY=V]` adds `fair_sched/TAG` with those
options (`KLLM_FAIR_SCHED_<KEY>`, or a full `KLLM_*` name). Each run gets a fresh server
(`--chunked-prefill-size --chunk`, `--schedule-policy`); seed s runs the setups in order, seed
s+1 in reverse. Per run: TTFT of the shorts that arrived before the long prompt's first token
(mean / P50 / P90 / max), medium TTFT (mean / max), long TTFT, wall time, and whether every
output equals fcfs's for the seed. Prints seed medians with min-max spread, ratios to fcfs and
to the best stock policy, and records `benchmarks/results/fair_sched/long_in_flight.json`.

    flock /tmp/kllm-bench.lock .venv/bin/python benchmarks/fair_sched/long_in_flight.py --seeds 2
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import Job, Outcome, fair_totals, parse_variant, run_jobs  # noqa: E402

from kllm_plugins.bench.record import record  # noqa: E402
from kllm_plugins.bench.schedule import poisson  # noqa: E402
from kllm_plugins.bench.stats import fmt_spread, ratio_of_medians, spread  # noqa: E402

Setup = tuple[list[str], dict[str, str], str]  # plugins, environment, --schedule-policy
STOCK = ("fcfs", "lpm", "shortest-prefill-first", "hrrn")
SETUPS: dict[str, Setup] = {**{p: ([], {}, p) for p in STOCK}, "fair_sched": (["fair_sched"], {}, "fcfs")}
METRICS = ("short_mean", "short_p50", "short_p90", "short_max", "medium_mean", "medium_max", "long_ttft", "wall")
COUNTERS = ("ride_passes", "shorts_beside_long", "yields_to_short", "limited_passes")
SHORT_NAMES = {"shortest-prefill-first": "spf"}


def parse_variants(specs: Sequence[str]) -> dict[str, Setup]:
    """`--variant` specs (`serving.parse_variant`) -> setups `fair_sched/TAG` (policy fcfs)."""
    return {name: (["fair_sched"], env, "fcfs") for name, env in map(parse_variant, specs)}


def add_workload_args(ap: argparse.ArgumentParser, long_tokens: int, rate: float, lead_s: float,
                      short: tuple[int, int], medium: tuple[int, int], chunk: int) -> None:
    """The workload's and the setups' options, with each benchmark's own defaults (CPU or GPU sizes)."""
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=long_tokens)
    ap.add_argument("--long-out", type=int, default=4)
    ap.add_argument("--shorts", type=int, default=24)
    ap.add_argument("--mediums", type=int, default=3)
    ap.add_argument("--rate", type=float, default=rate, help="short arrivals per second")
    ap.add_argument("--lead-s", type=float, default=lead_s, help="when the first short arrives")
    ap.add_argument("--short-len", type=int, nargs=2, default=list(short), metavar=("MIN", "MAX"),
                    help="short prompt tokens, uniform in [MIN, MAX]")
    ap.add_argument("--medium-len", type=int, nargs=2, default=list(medium), metavar=("MIN", "MAX"),
                    help="medium prompt tokens, uniform in [MIN, MAX]")
    ap.add_argument("--chunk", type=int, default=chunk)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS))
    ap.add_argument("--variant", action="append", default=[], metavar="TAG:KEY=V[,KEY=V]")


def workload(a: argparse.Namespace, seed: int) -> list[Job]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 3900) for _ in range(n)]

    jobs = [Job(f"s{seed}-long", 0.0, ids(a.long_tokens), a.long_out, "long")]
    arrivals = [a.lead_s + t for t in poisson(a.shorts, a.rate, seed)]
    for i, t in enumerate(arrivals):
        jobs.append(Job(f"s{seed}-short{i}", t, ids(rng.randint(*a.short_len)), rng.randint(8, 16), "short"))
    span = arrivals[-1] if arrivals else a.lead_s
    for i in range(a.mediums):
        jobs.append(Job(f"s{seed}-medium{i}", rng.uniform(a.lead_s, span), ids(rng.randint(*a.medium_len)),
                        rng.randint(8, 16), "medium"))
    return jobs


def run_metrics(outs: Sequence[Outcome]) -> dict[str, float]:
    """One run's figures (seconds). Shorts count when they arrived before the long prompt's first
    token; `medium_before_long` counts the mediums whose first token came before it. A figure
    over no requests is NaN."""
    long_ = next(o for o in outs if o.kind == "long")
    long_first = long_.arrival_s + long_.ttft_s
    shorts = [o.ttft_s for o in outs if o.kind == "short" and o.arrival_s < long_first]
    mediums = [o.ttft_s for o in outs if o.kind == "medium"]
    nan = float("nan")
    return {"short_n": float(len(shorts)),
            "medium_before_long": float(sum(o.arrival_s + o.ttft_s < long_first for o in outs if o.kind == "medium")),
            "short_mean": float(np.mean(shorts)) if shorts else nan,
            "short_p50": float(np.percentile(shorts, 50)) if shorts else nan,
            "short_p90": float(np.percentile(shorts, 90)) if shorts else nan,
            "short_max": max(shorts, default=nan),
            "medium_mean": float(np.mean(mediums)) if mediums else nan,
            "medium_max": max(mediums, default=nan),
            "long_ttft": long_.ttft_s,
            "wall": max(o.arrival_s + o.latency_s for o in outs)}


def same_outputs(outs: Sequence[Outcome], ref: Sequence[Outcome]) -> bool:
    ref_ids = {o.rid: o.output_ids for o in ref}
    return len(outs) == len(ref) and all(ref_ids.get(o.rid) == o.output_ids for o in outs)


def one_run(name: str, setup: Setup, a: argparse.Namespace, seed: int) -> tuple[dict[str, Any], list[Outcome]]:
    from kllm_plugins.models.tiny_llama import tiny_llama_path
    from kllm_plugins.testing.sglang_server import SGLangServer

    plugins, env, policy = setup
    srv = SGLangServer(str(tiny_llama_path()), plugins=plugins, env=env, max_total_tokens=a.max_total_tokens,
                       startup_timeout_s=600, extra_args=["--dtype", a.dtype, "--chunked-prefill-size", str(a.chunk),
                                                          "--schedule-policy", policy])
    try:
        srv.start()
        rng = random.Random(7)  # warm-up: one pass of each shape the run will see
        run_jobs(srv.base_url, [Job(f"warm{i}", 0.0, [rng.randrange(10, 3900) for _ in range(n)], 4, "warm")
                                for i, n in enumerate((100, 1000))])
        outs = run_jobs(srv.base_url, workload(a, seed))
        row: dict[str, Any] = {"setup": name, "seed": seed, **run_metrics(outs)}
        if plugins:
            row.update(fair_totals(srv, COUNTERS))
        return row, outs
    finally:
        srv.stop()


def summarize(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per setup: each metric's spread over seeds, ratio to fcfs and to the best stock policy
    (the stock setup, other than itself, with the smallest median), outputs equal to fcfs's."""
    per = {n: [r for r in runs if r["setup"] == n and "error" not in r] for n in names}

    def vals(n: str, m: str) -> list[float]:
        return [r[m] for r in per[n]]

    def ok(n: str, m: str) -> bool:
        return bool(per[n]) and all(v == v for v in vals(n, m))  # no NaN

    out: dict[str, Any] = {}
    for n in names:
        row: dict[str, Any] = {"runs": len(per[n]), "failed": sum(1 for r in runs if r["setup"] == n and "error" in r),
                               **{k: spread(vals(n, k)) if per[n] else None for k in ("short_n", "medium_before_long")}}
        same = [r["same_as_fcfs"] for r in per[n] if r.get("same_as_fcfs") is not None]
        row["same_as_fcfs"] = all(same) if same else None
        for m in METRICS:
            if not ok(n, m):
                continue
            cell: dict[str, Any] = {"s": spread(vals(n, m))}
            if n != "fcfs" and "fcfs" in per and ok("fcfs", m):
                cell["vs_fcfs"] = ratio_of_medians(vals(n, m), vals("fcfs", m))
            stock = [s for s in STOCK if s in per and s != n and ok(s, m)]
            if stock:
                best = min(stock, key=lambda s: float(np.median(vals(s, m))))
                cell["vs_best_stock"] = {"policy": best, **ratio_of_medians(vals(n, m), vals(best, m))}
            row[m] = cell
        if any(k in r for r in per[n] for k in COUNTERS):
            row["counters"] = {k: sum(r.get(k, 0) for r in per[n]) for k in COUNTERS}
        out[n] = row
    return out


def print_tables(summary: dict[str, Any]) -> None:
    cols = ("short_mean", "short_p90", "short_max", "medium_mean", "medium_max", "long_ttft", "wall")
    head = f"{'setup':24} {'shorts':>6} {'med<L':>5} " + " ".join(f"{c:>17}" for c in cols) + "  same"
    print("\nseconds, median over seeds [min-max]; shorts: those arriving before the long prompt's first token; "
          "med<L: mediums served before it")
    print(head)
    for n, row in summary.items():
        cells = " ".join(f"{fmt_spread(row[c]['s'], 2) if c in row else '-':>17}" for c in cols)
        sn, mb = (f"{row[k]['median']:.1f}" if row[k] else "-" for k in ("short_n", "medium_before_long"))
        print(f"{n:24} {sn:>6} {mb:>5} {cells}  {row['same_as_fcfs']}")
    for key, title in (("vs_fcfs", "ratio to fcfs"), ("vs_best_stock", "ratio to the best stock policy (which)")):
        print(f"\n{title}, median [min-max over seeds]")
        print(f"{'setup':24} " + " ".join(f"{c:>22}" for c in cols))
        for n, row in summary.items():
            if key == "vs_best_stock" and n in STOCK:
                continue
            cells = []
            for c in cols:
                r = row.get(c, {}).get(key)
                tag = f" {SHORT_NAMES.get(r['policy'], r['policy'])}" if r and "policy" in r else ""
                cells.append(f"{fmt_spread(r, 2) + tag if r else '-':>22}")
            if any(x.strip() != "-" for x in cells):
                print(f"{n:24} " + " ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap, long_tokens=7900, rate=10.0, lead_s=0.1, short=(32, 256), medium=(600, 1500), chunk=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--shared", default="shared 2-core, one benchmark at a time", help="what shares the machine")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    try:
        setups = {**{n: SETUPS[n] for n in a.setups}, **parse_variants(a.variant)}
    except (KeyError, ValueError) as exc:
        ap.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through one_run's finally: its server stops
    names, runs, t_start = list(setups), [], time.time()
    for seed in range(a.seeds):
        done: dict[str, list[Outcome]] = {}
        for name in (names if seed % 2 == 0 else names[::-1]):
            try:
                row, done[name] = one_run(name, setups[name], a, seed)
            except Exception as exc:  # noqa: BLE001 - a failed setup is a result; the others still run
                row = {"setup": name, "seed": seed, "error": str(exc)[-300:]}
            runs.append(row)
            print(f"[long_in_flight] seed {seed} {name}: " + (row.get("error") or " ".join(
                f"{k} {row[k]:.3g}" for k in ("short_n", "short_mean", "short_p90", "medium_mean", "medium_before_long", "long_ttft", "wall"))),
                flush=True)
        ref = done.get("fcfs")
        for row in runs:
            if row["seed"] == seed and row["setup"] in done:
                row["same_as_fcfs"] = same_outputs(done[row["setup"]], ref) if ref is not None else None
    summary = summarize(runs, names)
    print_tables(summary)
    wall = time.time() - t_start
    print(f"\nbenchmark wall time {wall:.0f}s")
    if not a.no_record:
        settings = {k: v for k, v in vars(a).items() if k not in ("no_record", "shared")}
        path = record("fair_sched", "long_in_flight", "python " + " ".join(sys.argv), summary, shared=a.shared,
                      settings=settings, setups={n: {"plugins": p, "env": e, "policy": pol} for n, (p, e, pol) in setups.items()},
                      runs=runs, wall_s=wall)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
