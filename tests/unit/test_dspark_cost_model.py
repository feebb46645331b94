"""Unit tests of the dspark online verify-step cost model (no SGLang)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig, OnlineStepCostModel, StepFeatures


def true_seconds(r: float, m: float, c: float, load: float = 1.0) -> float:
    """A synthetic GPU-like verify step: flat (memory-bound) until 128 tokens, then linear,
    plus KV read per context token and attention of verify tokens over their context."""
    mean_c = c / max(r, 1)
    return load * (0.008 + 5e-5 * r + 4e-5 * max(m - 128, 0) + 0.03 * c / 1e6 + 2e-9 * m * mean_c)


def random_step(rng: np.random.Generator) -> StepFeatures:
    r = int(rng.integers(4, 48))
    return StepFeatures(r, int(r * rng.integers(1, 9)), int(r * rng.integers(200, 4000)))


def feed(model: OnlineStepCostModel, rng: np.random.Generator, steps: int, load: float = 1.0,
         noise: float = 0.03, outlier_p: float = 0.0) -> list[float]:
    """Observe `steps` random steps; return the relative error of each prediction made before
    its observation (nan while the model is not ready)."""
    errs = []
    for _ in range(steps):
        f = random_step(rng)
        truth = true_seconds(f.num_reqs, f.verify_tokens, f.context_tokens, load)
        y = truth * (1 + noise * rng.standard_normal())
        if rng.random() < outlier_p:
            y *= 5.0
        errs.append(abs(float(model.predict(f.num_reqs, f.verify_tokens, f.context_tokens)) - truth) / truth
                    if model.ready else float("nan"))
        model.observe(f, y)
    return errs


def grid_error(model: OnlineStepCostModel, load: float = 1.0) -> float:
    errs = []
    for r in (4, 16, 40):
        for per in (1, 3, 6, 8):
            for cpr in (300, 3000):
                m, c = r * per, r * cpr
                t = true_seconds(r, m, c, load)
                errs.append(abs(float(model.predict(r, m, c)) - t) / t)
    return float(np.median(errs))


def test_learns_a_known_cost_surface() -> None:
    model = OnlineStepCostModel()
    feed(model, np.random.default_rng(0), 300)
    assert model.ready
    assert grid_error(model) < 0.06


def test_outlier_steps_do_not_drag_the_fit() -> None:
    robust = OnlineStepCostModel(CostModelConfig(huber_k=2.0))
    loose = OnlineStepCostModel(CostModelConfig(huber_k=1e6))  # effectively plain least squares
    feed(robust, np.random.default_rng(1), 300, outlier_p=0.1)
    feed(loose, np.random.default_rng(1), 300, outlier_p=0.1)
    assert grid_error(robust) < 0.08
    assert grid_error(loose) > 2 * grid_error(robust)


def test_context_length_is_priced() -> None:
    model = OnlineStepCostModel()
    feed(model, np.random.default_rng(2), 300)
    short, long = float(model.predict(32, 128, 32 * 200)), float(model.predict(32, 128, 32 * 4000))
    assert long > short * 1.05
    # The true knee (128 tokens) lies between the default knots, hence a looser bound here.
    assert abs(long - true_seconds(32, 128, 32 * 4000)) / true_seconds(32, 128, 32 * 4000) < 0.1


ADAPT_STEPS = 40
"""The stated bound: after a load step, predictions are back within 8% in this many steps."""


def test_load_step_change_readapts_within_stated_steps() -> None:
    model = OnlineStepCostModel()
    rng = np.random.default_rng(3)
    feed(model, rng, 300, load=1.0)
    errs = feed(model, rng, 200, load=2.0)
    assert np.nanmedian(errs[:3]) > 0.3  # the step really happened
    assert np.median(errs[ADAPT_STEPS:ADAPT_STEPS + 40]) < 0.08
    assert model.changes_detected >= 1
    assert grid_error(model, load=2.0) < 0.08


def test_change_detection_speeds_up_adaptation() -> None:
    on = OnlineStepCostModel(CostModelConfig(half_life_steps=200))
    off = OnlineStepCostModel(CostModelConfig(half_life_steps=200, change_discount=1.0))
    for model in (on, off):
        rng = np.random.default_rng(4)
        feed(model, rng, 300, load=1.0)
        feed(model, rng, 25, load=1.8)
    assert grid_error(on, load=1.8) < 0.1
    assert grid_error(off, load=1.8) > 2 * grid_error(on, load=1.8)


def test_not_ready_without_distinct_verify_sizes() -> None:
    model = OnlineStepCostModel()
    for _ in range(60):
        model.observe(StepFeatures(8, 64, 8000), 0.01)
    assert not model.ready
    model.observe(StepFeatures(8, 16, 8000), 0.008)
    model.observe(StepFeatures(8, 32, 8000), 0.009)
    assert model.ready


def test_bad_times_are_ignored() -> None:
    model = OnlineStepCostModel()
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        model.observe(StepFeatures(4, 8, 100), bad)
    assert model.observations == 0
    with pytest.raises(RuntimeError):
        model.predict(4, 8, 100)


@pytest.mark.parametrize(
    "field,value",
    [("half_life_steps", 0), ("window", 4), ("knots", (256, 64)), ("huber_k", 0), ("change_discount", 2.0),
     ("min_observations", 0), ("refit_every", 0)],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CostModelConfig(**{field: value})


@settings(max_examples=40, deadline=None)
@given(
    obs=st.lists(
        st.tuples(st.integers(1, 64), st.integers(1, 512), st.integers(0, 10**6), st.floats(1e-4, 1.0)),
        min_size=1,
        max_size=60,
    ),
    probe=st.tuples(st.integers(1, 64), st.integers(1, 600), st.integers(0, 2 * 10**6)),
)
def test_predictions_are_positive_and_finite(obs: list[tuple[int, int, int, float]], probe: tuple[int, int, int]) -> None:
    model = OnlineStepCostModel(CostModelConfig(min_observations=1, min_distinct_tokens=1))
    for r, m, c, y in obs:
        model.observe(StepFeatures(r, m, c), y)
    p = model.predict(*probe)
    assert np.isfinite(p) and p > 0


def test_new_context_regime_is_learned_not_mistaken_for_a_load_change() -> None:
    model = OnlineStepCostModel()

    def cost(m: int, ctx: int) -> float:
        return 0.004 + 0.0001 * m + 3e-9 * m * ctx

    for ctx in (1600, 32000, 128000):  # contexts grow: each phase is territory never seen before
        for m in range(8, 65, 2):
            model.observe(StepFeatures(8, m, ctx), cost(m, ctx))
    assert model.changes_detected == 0
    for ctx in (1600, 128000):
        for m in (8, 64):
            assert abs(float(model.predict(8, m, ctx)) - cost(m, ctx)) / cost(m, ctx) < 0.05
