"""Unit tests of the dspark verify-budget planner (no SGLang)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kllm_plugins.plugins.dspark.core.budget import (
    BudgetPlanner,
    PlannerConfig,
    expected_tokens,
    plan_budget,
    resolve_lens,
    verify_lens_for_budgets,
)
from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig, OnlineStepCostModel, StepFeatures


def survival_from(conf: np.ndarray) -> np.ndarray:
    return np.cumprod(conf, axis=1)


def naive_lens(survival: np.ndarray, budget: int, min_len: int, max_len: int, eps: float) -> np.ndarray:
    """Greedy reference: hand out `budget` positions one at a time, best survival first."""
    r, _ = survival.shape
    cands = [(-survival[i, j], j, i) for i in range(r) for j in range(min(max_len, survival.shape[1]))
             if survival[i, j] >= eps]
    cands.sort()
    extra = np.zeros(r, dtype=np.int64)
    for _, _, i in cands[:budget]:
        extra[i] += 1
    return np.clip(min_len + extra, max(min_len, 1), max_len)


conf_arrays = hnp.arrays(
    np.float64,
    st.tuples(st.integers(1, 6), st.integers(1, 7)),
    elements=st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 1.0]),
)


@settings(max_examples=60, deadline=None)
@given(conf=conf_arrays, min_len=st.integers(1, 3), max_extra=st.integers(0, 7))
def test_vectorised_allocator_matches_greedy_reference(conf: np.ndarray, min_len: int, max_extra: int) -> None:
    survival = survival_from(conf)
    lo, hi = resolve_lens(conf.shape[1], min_len, min_len + max_extra)
    lens = verify_lens_for_budgets(survival, min_len=lo, max_len=hi, eps=1e-6)
    for b in range(lens.shape[0]):
        assert np.array_equal(lens[b], naive_lens(survival, b, lo, hi, 1e-6))
    assert lens.min() >= lo and lens.max() <= hi


@settings(max_examples=60, deadline=None)
@given(conf=conf_arrays, base=st.floats(1e-3, 1e-1), slope=st.floats(0, 1e-2), knee=st.integers(0, 40),
       min_len=st.integers(1, 2))
def test_throughput_plan_is_the_brute_force_optimum(conf: np.ndarray, base: float, slope: float, knee: int,
                                                     min_len: int) -> None:
    survival = survival_from(conf)
    lo, hi = resolve_lens(conf.shape[1], min_len, 0)

    def cost(m: np.ndarray) -> np.ndarray:
        return base + slope * np.maximum(np.asarray(m) - knee, 0)

    plan = plan_budget(survival, cost, min_len=lo, max_len=hi)
    lens = verify_lens_for_budgets(survival, min_len=lo, max_len=hi)
    best = max(expected_tokens(survival, lens[b]).sum() / cost(lens[b].sum()) for b in range(lens.shape[0]))
    assert plan.throughput == pytest.approx(best, rel=1e-9)
    assert plan.verify_tokens == lens[plan.budget].sum()


def test_flat_cost_verifies_everything_like_stock() -> None:
    survival = survival_from(np.full((4, 7), 0.6))
    plan = plan_budget(survival, lambda m: np.full(np.shape(m), 0.01), min_len=1, max_len=8)
    assert plan.budget == 4 * 7
    assert plan.verify_tokens == 4 * 8


def test_compute_bound_cost_trims_unlikely_positions() -> None:
    conf = np.array([[0.95] * 7, [0.9] * 7, [0.3] * 7, [0.2] * 7])
    survival = survival_from(conf)
    plan = plan_budget(survival, lambda m: 0.01 + 0.002 * np.asarray(m), min_len=1, max_len=8)
    lens = verify_lens_for_budgets(survival, min_len=1, max_len=8)[plan.budget]
    assert 0 < plan.budget < 28
    assert lens[0] > lens[2] and lens[1] > lens[3]


def test_min_len_above_one_counts_the_floor_drafts() -> None:
    survival = np.ones((3, 7))
    lens = verify_lens_for_budgets(survival, min_len=3, max_len=8)
    assert list(lens[0]) == [3, 3, 3]
    assert expected_tokens(survival, lens[0]).tolist() == [3.0, 3.0, 3.0]


def sla_case() -> tuple[np.ndarray, object]:
    # Two confident requests and two weak ones; every verify token adds to the step time.
    conf = np.array([[0.98] * 7, [0.97] * 7, [0.35] * 7, [0.3] * 7])
    return survival_from(conf), (lambda m: 0.01 + 0.0004 * np.asarray(m))


@pytest.mark.parametrize("softness", [0.0, 0.1])
def test_sla_objective_keeps_every_request_above_the_floor(softness: float) -> None:
    survival, cost = sla_case()
    thr = plan_budget(survival, cost, min_len=1, max_len=8, sla_tokens_per_s=75.0)
    sla = plan_budget(survival, cost, min_len=1, max_len=8, objective="sla", sla_tokens_per_s=75.0,
                      sla_softness=softness)
    assert thr.sla_attainment < 1.0
    assert sla.sla_attainment == 1.0
    assert sla.budget < thr.budget
    assert sla.throughput <= thr.throughput


def test_infeasible_sla_maximises_attainment_then_throughput() -> None:
    survival, cost = sla_case()
    sla = plan_budget(survival, cost, min_len=1, max_len=8, objective="sla", sla_tokens_per_s=150.0)
    lens = verify_lens_for_budgets(survival, min_len=1, max_len=8)
    attain = []
    for b in range(lens.shape[0]):
        secs = cost(lens[b].sum())
        attain.append(float((expected_tokens(survival, lens[b]) / secs >= 150.0).mean()))
    assert sla.sla_attainment == max(attain)
    assert 0 < sla.sla_attainment < 1


def test_objective_validation() -> None:
    with pytest.raises(ValueError, match="objective"):
        PlannerConfig(objective="latency")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sla_tokens_per_s"):
        PlannerConfig(objective="sla")
    with pytest.raises(ValueError, match="max_verify_len"):
        PlannerConfig(min_verify_len=4, max_verify_len=2)


def test_planner_defers_to_stock_until_the_model_is_trusted() -> None:
    model = OnlineStepCostModel(CostModelConfig(min_observations=4))
    planner = BudgetPlanner(PlannerConfig(explore_prob=0.0, warmup_explore_prob=0.0), model)
    survival = survival_from(np.full((4, 7), 0.8))
    assert planner.decide(survival, 1000) is None
    for m in (4, 8, 16, 24, 32):
        model.observe(StepFeatures(4, m, 1000), 0.01 + 0.001 * m)
    plan = planner.decide(survival, 1000)
    assert plan is not None and plan.source == "model"


def test_exploration_rate_and_range() -> None:
    model = OnlineStepCostModel()
    planner = BudgetPlanner(PlannerConfig(warmup_explore_prob=0.3, seed=7), model)
    survival = survival_from(np.full((4, 7), 0.8))
    plans = [planner.decide(survival) for _ in range(2000)]
    explored = [p for p in plans if p is not None]
    assert all(p.source == "explore" for p in explored)
    assert 0.25 < len(explored) / len(plans) < 0.35
    budgets = {p.budget for p in explored}
    assert min(budgets) == 0 and max(budgets) == 28


def test_trusted_exploration_stays_near_the_optimum_and_rises_after_a_change() -> None:
    model = OnlineStepCostModel(CostModelConfig(min_observations=4))
    for m in range(4, 33, 2):
        model.observe(StepFeatures(4, m, 1000), 0.004 + 0.001 * m)
    cfg = PlannerConfig(explore_prob=0.1, recovery_explore_prob=0.6, recovery_steps=200, seed=3)
    planner = BudgetPlanner(cfg, model)
    survival = survival_from(np.full((4, 7), 0.8))
    best = plan_budget(survival, lambda m: model.predict(4, m, 1000), min_len=1, max_len=8).budget
    plans = [planner.decide(survival, 1000) for _ in range(400)]
    explored = [p for p in plans if p is not None and p.source == "explore"]
    assert 0.05 < len(explored) / 400 < 0.15
    assert all(abs(p.budget - best) <= max(2, 28 // 4) for p in explored)
    model.changes_detected += 1  # as the model does when it detects a load change
    plans = [planner.decide(survival, 1000) for _ in range(200)]
    assert sum(p is not None and p.source == "explore" for p in plans) / 200 > 0.45
