"""Layer: plugin core (no SGLang import). Choosing a DSPARK verify-token budget.

Semantics follow SGLang 0.5.23's planner so the number we return means what SGLang expects:
survival[i, j] is the probability that draft token j+1 of request i is accepted (the cumulative
product of the per-position confidences); every request verifies a floor of `min_len` tokens
(the anchor included); the budget is how many extra positions SGLang's top-k allocator then
hands out, best survival first across the whole batch (ties: earlier position, then earlier
request), capped at `max_len` per request.

For each candidate budget b we replay that allocator exactly, which gives per-request verify
lengths L_i(b), the verify tokens M(b) = sum L_i(b) and expected accepted tokens
E_i(b) = 1 + sum_{j < L_i(b) - 1} survival[i, j]. With a step-time model t(M):

  throughput objective   maximise sum_i E_i(b) / t(M(b))
  sla objective          maximise the fraction of requests with E_i(b) / t(M(b)) >= sla,
                         then throughput among the budgets that reach it

Unlike SGLang's stock score (tau = R + prefix sum of the sorted survivals), replaying the
allocator stays correct when min_len > 1 and when the max_len cap binds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from kllm_plugins.plugins.dspark.core.cost_model import OnlineStepCostModel

Objective = Literal["throughput", "sla"]
OBJECTIVES: tuple[str, ...] = ("throughput", "sla")


@dataclass(frozen=True)
class BudgetPlan:
    budget: int
    """Extra verify positions above the per-request floor (SGLang's `verify_token_budget`)."""
    verify_tokens: int
    expected_tokens: float
    step_seconds: float
    throughput: float
    """Expected accepted tokens per second for the batch."""
    sla_attainment: float
    """Fraction of requests whose expected speed reaches the SLA (1.0 when no SLA is set)."""
    source: str = "model"
    """"model" (optimised), "explore" (a random budget that teaches the cost model)."""


def resolve_lens(gamma: int, min_len: int, max_len: int) -> tuple[int, int]:
    """SGLang's convention: max_len 0 means gamma + 1. Both are clamped to [1, gamma + 1]."""
    hi = gamma + 1 if max_len <= 0 else min(max_len, gamma + 1)
    lo = max(1, min(min_len, hi))
    return lo, hi


def verify_lens_for_budgets(survival: np.ndarray, *, min_len: int, max_len: int, eps: float = 1e-6) -> np.ndarray:
    """Per-request verify lengths for every budget 0..K (K = valid candidates): shape (K+1, R)."""
    survival = np.asarray(survival, dtype=np.float64)
    num_reqs, width = survival.shape
    window = survival[:, :max_len]
    w = window.shape[1]
    flat = window.reshape(-1)
    req = np.repeat(np.arange(num_reqs), w)
    pos = np.tile(np.arange(w), num_reqs)
    valid = flat >= eps
    key = np.where(valid, flat, -np.inf)
    order = np.lexsort((req, pos, -key))  # primary: survival desc; then position; then request
    k = int(valid.sum())
    chosen = req[order[:k]]
    counts = np.zeros((k + 1, num_reqs), dtype=np.int64)
    if k:
        onehot = np.zeros((k, num_reqs), dtype=np.int64)
        onehot[np.arange(k), chosen] = 1
        counts[1:] = np.cumsum(onehot, axis=0)
    return np.clip(min_len + counts, max(min_len, 1), max_len)


def expected_tokens(survival: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Expected accepted tokens (bonus token included) per request for verify lengths `lens`."""
    survival = np.asarray(survival, dtype=np.float64)
    prefix = np.concatenate([np.zeros((survival.shape[0], 1)), np.cumsum(survival, axis=1)], axis=1)
    idx = np.clip(np.atleast_2d(lens) - 1, 0, survival.shape[1])  # (B, R): drafts verified
    out = 1.0 + np.take_along_axis(prefix, idx.T, axis=1).T
    return out if np.ndim(lens) == 2 else out[0]


def plan_budget(
    survival: np.ndarray,
    step_seconds: Callable[[np.ndarray], np.ndarray],
    *,
    min_len: int,
    max_len: int,
    eps: float = 1e-6,
    objective: Objective = "throughput",
    sla_tokens_per_s: float = 0.0,
    sla_softness: float = 0.0,
) -> BudgetPlan:
    """Best budget for one step. `step_seconds(M)` maps an array of verify-token totals to seconds."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    lens = verify_lens_for_budgets(survival, min_len=min_len, max_len=max_len, eps=eps)
    per_req = expected_tokens(survival, lens)  # (K+1, R)
    tokens = lens.sum(axis=1)
    seconds = np.asarray(step_seconds(tokens), dtype=np.float64)
    total = per_req.sum(axis=1)
    thr = total / seconds
    if sla_tokens_per_s > 0:
        attain = (per_req / seconds[:, None] >= sla_tokens_per_s).mean(axis=1)
    else:
        attain = np.ones_like(thr)
    if objective == "sla" and sla_tokens_per_s > 0:
        if sla_softness > 0:
            # Expected speeds come from noisy confidences: score each request's chance of meeting
            # the SLA smoothly, so the argmax does not chase noise across the threshold.
            z = (per_req / seconds[:, None] - sla_tokens_per_s) / (sla_softness * sla_tokens_per_s)
            target = (1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))).mean(axis=1)
            tol = 0.005
        else:
            target, tol = attain, 1e-12
        score = np.where(target >= target.max() - tol, thr, -np.inf)
    else:
        score = thr
    b = int(np.argmax(score))  # first maximum: the smallest budget among ties
    return BudgetPlan(b, int(tokens[b]), float(total[b]), float(seconds[b]), float(thr[b]), float(attain[b]))


@dataclass(frozen=True)
class PlannerConfig:
    min_verify_len: int = 1
    max_verify_len: int = 0
    """0 means gamma + 1 (verify the whole draft block at most)."""
    survival_eps: float = 1e-6
    objective: Objective = "throughput"
    sla_tokens_per_s: float = 0.0
    sla_softness: float = 0.1
    """Width of the smooth SLA indicator, as a fraction of the SLA (0: hard threshold)."""
    explore_prob: float = 0.02
    """Probability of a random budget once the model is trusted (keeps it calibrated)."""
    warmup_explore_prob: float = 0.5
    """Probability of a random budget while the model is still learning."""
    recovery_explore_prob: float = 0.25
    """Probability of a perturbed budget for `recovery_steps` steps after a detected load change,
    so the cost model re-learns the slope near the new optimum quickly."""
    recovery_steps: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        if self.min_verify_len < 1:
            raise ValueError(f"min_verify_len must be >= 1, got {self.min_verify_len}")
        if self.max_verify_len < 0:
            raise ValueError(f"max_verify_len must be >= 0 (0: gamma + 1), got {self.max_verify_len}")
        if self.max_verify_len and self.max_verify_len < self.min_verify_len:
            raise ValueError(
                f"max_verify_len ({self.max_verify_len}) must be >= min_verify_len ({self.min_verify_len})"
            )
        if self.survival_eps < 0:
            raise ValueError(f"survival_eps must be >= 0, got {self.survival_eps}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.sla_tokens_per_s < 0:
            raise ValueError(f"sla_tokens_per_s must be >= 0, got {self.sla_tokens_per_s}")
        if self.sla_softness < 0:
            raise ValueError(f"sla_softness must be >= 0, got {self.sla_softness}")
        if self.objective == "sla" and self.sla_tokens_per_s <= 0:
            raise ValueError("sla_tokens_per_s must be > 0 when objective is 'sla'")
        if self.recovery_steps < 0:
            raise ValueError(f"recovery_steps must be >= 0, got {self.recovery_steps}")
        for name in ("explore_prob", "warmup_explore_prob", "recovery_explore_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


class BudgetPlanner:
    """Online planner: the learned cost model, the objective and a little exploration."""

    def __init__(self, config: PlannerConfig, model: OnlineStepCostModel) -> None:
        self.config = config
        self.model = model
        self._rng = np.random.default_rng(config.seed)
        self._changes_seen = 0
        self._recovery_left = 0

    def decide(self, survival: np.ndarray, context_tokens: int = 0) -> BudgetPlan | None:
        """The budget for this step, or None when the model is not trusted yet and this step
        does not explore (the caller then keeps SGLang's own decision).

        Exploration is uniform over all budgets while warming up; once the model is trusted it
        perturbs the optimum locally (within a quarter of the range), which is where the slope
        matters and costs little throughput.
        """
        survival = np.asarray(survival, dtype=np.float64)
        num_reqs, gamma = survival.shape
        lo, hi = resolve_lens(gamma, self.config.min_verify_len, self.config.max_verify_len)
        ready = self.model.ready
        if self.model.changes_detected != self._changes_seen:
            self._changes_seen = self.model.changes_detected
            self._recovery_left = self.config.recovery_steps
        if not ready:
            p = self.config.warmup_explore_prob
        elif self._recovery_left > 0:
            self._recovery_left -= 1
            p = self.config.recovery_explore_prob
        else:
            p = self.config.explore_prob
        explore = p > 0 and self._rng.random() < p
        if not ready:
            return self._explore(survival, lo, hi, context_tokens, None) if explore else None
        plan = plan_budget(
            survival,
            lambda m: self.model.predict(num_reqs, m, context_tokens),
            min_len=lo,
            max_len=hi,
            eps=self.config.survival_eps,
            objective=self.config.objective,
            sla_tokens_per_s=self.config.sla_tokens_per_s,
            sla_softness=self.config.sla_softness,
        )
        return self._explore(survival, lo, hi, context_tokens, plan.budget) if explore else plan

    def _explore(self, survival: np.ndarray, lo: int, hi: int, context_tokens: int, around: int | None) -> BudgetPlan:
        lens = verify_lens_for_budgets(survival, min_len=lo, max_len=hi, eps=self.config.survival_eps)
        k = lens.shape[0] - 1
        if around is None:
            b = int(self._rng.integers(0, k + 1))
        else:
            width = max(2, k // 4)
            b = int(np.clip(around + self._rng.integers(-width, width + 1), 0, k))
        per_req = expected_tokens(survival, lens[b : b + 1])[0]
        tokens = int(lens[b].sum())
        secs = float(self.model.predict(survival.shape[0], tokens, context_tokens)) if self.model.ready else float("nan")
        thr = float(per_req.sum() / secs) if self.model.ready else float("nan")
        return BudgetPlan(b, tokens, float(per_req.sum()), secs, thr, float("nan"), source="explore")
