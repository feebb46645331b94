"""Layer: plugin core (no SGLang import). Cost model, budget planner and step clock of the dspark plugin."""
from __future__ import annotations

from kllm_plugins.plugins.dspark.core.budget import (
    BudgetPlan,
    BudgetPlanner,
    PlannerConfig,
    plan_budget,
    verify_lens_for_budgets,
)
from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig, OnlineStepCostModel, StepFeatures
from kllm_plugins.plugins.dspark.core.step_clock import StepClock, StepObservation

__all__ = [
    "BudgetPlan",
    "BudgetPlanner",
    "CostModelConfig",
    "OnlineStepCostModel",
    "PlannerConfig",
    "StepClock",
    "StepFeatures",
    "StepObservation",
    "plan_budget",
    "verify_lens_for_budgets",
]
