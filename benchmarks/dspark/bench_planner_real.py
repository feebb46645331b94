"""Benchmark (replay, CPU): the online verify-budget planner on a real drafter's confidences and
real step costs, against every fixed verify length.

Inputs come from `bench_drafters.py eval` on the GPU machine: the trained DSpark drafter's raw
confidence logits and true accepted counts for every (request, step) of the held-out greedy runs
(`dspark_records.pt`), its per-position STS temperatures, and the measured seconds of a target
verify forward (batch B, L tokens per request, context 256) and of a draft block (`dspark_gpu.json`).
Replay: each step draws B (request, step) events; a policy picks per-request verify lengths L_i;
request i gains min(n_i, L_i - 1) + 1 tokens; the step costs draft(B) + verify(B, sum L_i / B)
(linear interpolation in L, times a log-normal jitter of 3%). Policies:
  fixed_L   every request verifies L tokens (L = 1..gamma+1): the sweep for "best fixed"
  online    the plugin's planner (core/budget.py) with the online cost model (core/cost_model.py),
            fed the replayed step times; calibrated confidences, synchronous (no 2-step lag)
Load change at half time: phase A at concurrency `--batch-a`, phase B at `--batch-b` (measured
costs of that batch) and a co-tenant multiplying the verify cost's per-token part by `--contention`.

    python benchmarks/dspark/bench_planner_real.py --gpu-json benchmarks/results/dspark_gpu.json \
        --records /path/dspark_records.pt [--steps 1500] [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from kllm_plugins.bench import stats
from kllm_plugins.bench.record import build_summary, write_summary
from kllm_plugins.plugins.dspark.core.budget import BudgetPlanner, PlannerConfig, resolve_lens, verify_lens_for_budgets
from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig, OnlineStepCostModel, StepFeatures

CONTEXT = 256


class MeasuredCost:
    def __init__(self, gpu: dict, gamma: int, smooth: bool = False) -> None:
        self.verify: dict[int, np.ndarray] = {}
        for key, sec in gpu["step_costs_context256"].items():
            b, length = (int(x) for x in key.split(","))
            self.verify.setdefault(b, np.zeros(gamma + 2))[length] = sec
        if smooth:  # host jitter dominates single medians: a least-squares line in L per batch
            lens = np.arange(1, gamma + 2)
            for b, row in self.verify.items():
                slope, icpt = np.polyfit(lens, row[1:], 1)
                row[1:] = icpt + max(slope, 0.0) * lens
        self.draft = {int(b): s for b, s in gpu.get("draft_costs_context256", {}).items()}
        self.gamma = gamma

    def seconds(self, batch: int, verify_tokens: int, contention: float = 1.0) -> float:
        row = self.verify[batch]
        mean_len = verify_tokens / batch
        lo = int(min(max(math.floor(mean_len), 1), self.gamma + 1))
        hi = min(lo + 1, self.gamma + 1)
        frac = mean_len - lo
        v = row[lo] + (row[hi] - row[lo]) * frac
        v = row[1] + contention * (v - row[1])
        return float(v + self.draft.get(batch, 0.0))


def replay(policy: str | int, events: tuple[np.ndarray, np.ndarray], cost: MeasuredCost, phases: list[dict], steps: int,
           seed: int, gamma: int) -> list[float]:
    """Tokens/s of each phase."""
    surv_all, acc_all = events
    rng = np.random.default_rng(seed)
    model = OnlineStepCostModel(CostModelConfig(refit_every=4))
    planner = BudgetPlanner(PlannerConfig(seed=seed), model)
    lo, hi = resolve_lens(gamma, 1, 0)
    out = []
    for ph in phases:
        tokens = seconds = 0.0
        b = ph["batch"]
        for _ in range(steps):
            idx = rng.integers(0, len(acc_all), size=b)
            surv, n = surv_all[idx], acc_all[idx]
            if policy == "online":
                plan = planner.decide(surv, CONTEXT * b)
                lens_all = verify_lens_for_budgets(surv, min_len=lo, max_len=hi)
                lens = lens_all[-1] if plan is None else lens_all[plan.budget]
            else:
                lens = np.full(b, int(policy))
            gained = np.minimum(n, lens - 1) + 1
            m = int(lens.sum())
            t = cost.seconds(b, m, ph["contention"]) * float(np.exp(rng.normal(0, 0.03)))
            if policy == "online":
                model.observe(StepFeatures(b, m, CONTEXT * b), t)
            tokens += float(gained.sum())
            seconds += t
        out.append(tokens / seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-json", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch-a", type=int, default=16)
    ap.add_argument("--batch-b", type=int, default=64)
    ap.add_argument("--contention", type=float, default=3.0)
    ap.add_argument("--smooth", action="store_true", help="fit a line in L per batch to the measured costs")
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    gpu = json.loads(a.gpu_json.read_text())
    gamma = int(gpu["gamma"])
    rec = torch.load(a.records, weights_only=True)
    conf = torch.cat([c.float() for c in rec["confidence"]])
    temps = torch.tensor(rec["temperatures"], dtype=torch.float64)
    surv = torch.cumprod(torch.sigmoid(conf.double() / temps), dim=1).numpy()
    acc = torch.cat(rec["accepted"]).numpy().astype(np.int64)
    cost = MeasuredCost(gpu, gamma, smooth=a.smooth)
    phases = [{"batch": a.batch_a, "contention": 1.0}, {"batch": a.batch_b, "contention": a.contention}]
    results: dict[str, list[list[float]]] = {}
    for pol in ["online", *range(1, gamma + 2)]:
        results[str(pol)] = [replay(pol, (surv, acc), cost, phases, a.steps, seed, gamma) for seed in range(a.seeds)]
    med = {k: [float(np.median([r[i] for r in v])) for i in range(2)] for k, v in results.items()}
    fixed = {k: v for k, v in med.items() if k != "online"}
    best_a = max(fixed, key=lambda k: fixed[k][0])
    best_b = max(fixed, key=lambda k: fixed[k][1])
    summary = {
        "command": "python benchmarks/dspark/bench_planner_real.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v not in (None, False, True) and k != "json_out")
            + (" --smooth" if a.smooth else ""),
        "online_vs_best_fixed": med["online"][0] / fixed[best_a][0],
        "after_load_change_vs_best_fixed": med["online"][1] / fixed[best_a][1],
        "after_load_change_vs_best_fixed_in_hindsight": med["online"][1] / fixed[best_b][1],
        "best_fixed_verify_len": [int(best_a), int(best_b)],
        "tokens_per_s": med,
        "phases": phases, "steps_per_phase": a.steps, "seeds": a.seeds, "events": int(len(acc)),
        "replay": True,
    }
    print(f"{'policy':>8} {'phase A tok/s':>14} {'phase B tok/s':>14}")
    for k, v in med.items():
        print(f"{k:>8} {v[0]:14.1f} {v[1]:14.1f}")
    per_seed = {k: [[r[i] for r in v] for i in range(2)] for k, v in results.items()}
    # the harness's ratio of medians with the per-seed spread (seeds are paired: the same replay draws)
    metrics = {"online_vs_best_fixed": stats.ratio_of_medians(per_seed["online"][0], per_seed[best_a][0]),
               "after_load_change_vs_best_fixed": stats.ratio_of_medians(per_seed["online"][1], per_seed[best_a][1]),
               "after_load_change_vs_best_fixed_in_hindsight": stats.ratio_of_medians(per_seed["online"][1],
                                                                                     per_seed[best_b][1])}
    print(json.dumps({k: v for k, v in summary.items() if k != "tokens_per_s"}, indent=1))
    print("ratios of medians [per-seed min-max]: " + "; ".join(f"{k} {stats.fmt_spread(v)}" for k, v in metrics.items()))
    if a.json_out:
        command = summary.pop("command")
        write_summary(a.json_out, build_summary(command, metrics, **summary))


if __name__ == "__main__":
    main()
