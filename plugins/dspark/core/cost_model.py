"""Layer: plugin core (no SGLang import). An online model of DSPARK verify-step time.

SGLang's planner prices a verify budget with a steps-per-second table profiled offline for one
load; without that table it verifies everything. This model learns the price online instead,
from the step times the server actually sees, as a function of

    R  requests in the batch,
    M  tokens the verify forward processes (the sum of per-request verify lengths),
    C  context tokens of the batch (the sum of prefix lengths),

through a small linear basis: an intercept, R, a piecewise-linear spline in M (the knots mark
where a step stops being memory-bound), C (KV read once per request) and M x mean(C)
(attention of every verify token over its request's context).

Fit: ridge regression over a bounded window of recent steps, observations weighted by
exponential age (half-life in steps), made robust to outliers (preemption, host jitter) by
Huber-weighted iterative reweighting. Change detection: a run of same-signed residuals beyond
`change_sigma` robust standard deviations means the load changed (a co-tenant, a new context
mix), and the older observations are discounted at once instead of waiting for the half-life.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("kllm.dspark")


@dataclass(frozen=True)
class StepFeatures:
    """What a verify step costs depends on: requests, verify tokens and context tokens."""

    num_reqs: int
    verify_tokens: int
    context_tokens: int = 0


@dataclass(frozen=True)
class CostModelConfig:
    half_life_steps: float = 64.0
    """Age, in observed steps, at which an observation's weight halves."""
    window: int = 256
    """Most recent observations kept for the fit."""
    min_observations: int = 16
    """Observations needed (with `min_distinct_tokens` verify sizes) before the model is trusted."""
    min_distinct_tokens: int = 3
    knots: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    """Verify-token counts where the step-time slope may change."""
    token_scale: float = 64.0
    context_scale: float = 65536.0
    """Feature scales (tokens): verify tokens, batch context tokens, mean context per request."""
    mean_context_scale: float = 4096.0
    ridge: float = 1e-6
    """Numerical stabiliser only: larger values shrink slopes that the data excites weakly."""
    huber_k: float = 2.0
    """Residuals beyond huber_k robust sigmas get down-weighted in the fit."""
    change_run: int = 6
    """Consecutive same-signed outlying residuals that signal a load change."""
    change_sigma: float = 4.0
    change_discount: float = 0.02
    """Weight factor applied to observations older than a detected change."""
    change_max_leverage: float = 0.3
    """Only residuals of steps inside the data seen so far (leverage below this) can signal a
    change; a step in a new region (a context length never seen) is extrapolation, not drift."""
    refit_every: int = 1
    """Refit after this many observations (raise it to save host time per step)."""

    def __post_init__(self) -> None:
        if self.half_life_steps <= 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        if self.window < 8:
            raise ValueError(f"window must be >= 8, got {self.window}")
        if not 1 <= self.min_observations <= self.window:
            raise ValueError(f"min_observations must be in [1, window], got {self.min_observations}")
        if self.min_distinct_tokens < 1:
            raise ValueError(f"min_distinct_tokens must be >= 1, got {self.min_distinct_tokens}")
        if list(self.knots) != sorted(set(self.knots)) or any(k <= 0 for k in self.knots):
            raise ValueError(f"knots must be positive and strictly increasing, got {self.knots}")
        for name in ("token_scale", "context_scale", "mean_context_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge}")
        if self.huber_k <= 0:
            raise ValueError(f"huber_k must be > 0, got {self.huber_k}")
        if self.change_run < 2:
            raise ValueError(f"change_run must be >= 2, got {self.change_run}")
        if self.change_sigma <= 0:
            raise ValueError(f"change_sigma must be > 0, got {self.change_sigma}")
        if self.change_max_leverage <= 0:
            raise ValueError(f"change_max_leverage must be > 0, got {self.change_max_leverage}")
        if not 0 <= self.change_discount <= 1:
            raise ValueError(f"change_discount must be in [0, 1], got {self.change_discount}")
        if self.refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {self.refit_every}")


class OnlineStepCostModel:
    """Predicts verify-step seconds from (requests, verify tokens, context tokens)."""

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        n = self.config.window
        self._x: deque[np.ndarray] = deque(maxlen=n)
        self._y: deque[float] = deque(maxlen=n)
        self._tokens: deque[int] = deque(maxlen=n)
        self._age: deque[int] = deque(maxlen=n)
        self._mult: deque[float] = deque(maxlen=n)
        self._t = 0
        self._theta: np.ndarray | None = None
        self._a_inv: np.ndarray | None = None
        self._y_unit = 1.0
        self._sigma = float("inf")
        self._run_sign = 0
        self._run_len = 0
        self._since_fit = 0
        self.observations = 0
        self.changes_detected = 0

    # -- features -------------------------------------------------------------------------
    @property
    def num_features(self) -> int:
        return 5 + len(self.config.knots)

    def design(self, num_reqs: Any, verify_tokens: Any, context_tokens: Any) -> np.ndarray:
        """Feature rows for broadcastable arrays of R, M and C."""
        cfg = self.config
        r, m, c = np.broadcast_arrays(
            np.asarray(num_reqs, dtype=np.float64),
            np.asarray(verify_tokens, dtype=np.float64),
            np.asarray(context_tokens, dtype=np.float64),
        )
        ts, cs = cfg.token_scale, cfg.context_scale
        cols = [np.ones_like(m), r / ts, m / ts]
        cols += [np.maximum(m - k, 0.0) / ts for k in cfg.knots]
        mean_c = np.where(r > 0, c / np.maximum(r, 1.0), 0.0)
        cols += [c / cs, (m / ts) * (mean_c / cfg.mean_context_scale)]
        return np.stack(cols, axis=-1)

    # -- learning -------------------------------------------------------------------------
    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record one measured step. Non-finite or non-positive times are ignored."""
        if not np.isfinite(seconds) or seconds <= 0:
            return
        x = self.design(features.num_reqs, features.verify_tokens, features.context_tokens)
        self._detect_change(x, float(seconds))
        self._x.append(x)
        self._y.append(float(seconds))
        self._tokens.append(int(features.verify_tokens))
        self._age.append(self._t)
        self._mult.append(1.0)
        self._t += 1
        self.observations += 1
        self._since_fit += 1
        if self._theta is None or self._since_fit >= self.config.refit_every:
            self._fit()

    def _detect_change(self, x: np.ndarray, y: float) -> None:
        if self._theta is None or not np.isfinite(self._sigma) or not self.ready:
            return
        resid = (y - float(x @ self._theta) * self._y_unit) / self._y_unit
        sign = 1 if resid > 0 else -1
        leverage = float(x @ self._a_inv @ x) if self._a_inv is not None else 0.0
        if leverage > self.config.change_max_leverage:
            return  # extrapolating: the model is ignorant here, the load need not have changed
        if abs(resid) > self.config.change_sigma * self._sigma:
            self._run_len = self._run_len + 1 if sign == self._run_sign else 1
            self._run_sign = sign
        else:
            self._run_len, self._run_sign = 0, 0
        if self._run_len >= self.config.change_run:
            self._run_len, self._run_sign = 0, 0
            if self._explainable_run(x, y):
                return  # new territory the features can fit (e.g. longer contexts), not drift
            keep = self.config.change_run - 1  # the run's earlier members are already stored
            n = len(self._mult)
            for i in range(max(0, n - keep)):
                self._mult[i] *= self.config.change_discount
            self.changes_detected += 1
            self._since_fit = self.config.refit_every  # refit right after this observation
            logger.info("kllm dspark: verify cost shift detected (%+.1f sigma); old steps discounted", resid / self._sigma)

    def _explainable_run(self, x: np.ndarray, y: float) -> bool:
        """Would a plain weighted least-squares fit over everything, the run included, put the
        run's steps back within change_sigma? Then the run is a region the model had not seen."""
        run = self.config.change_run
        X = np.vstack([np.stack(self._x), x[None, :]])
        Y = np.append(np.asarray(self._y), y) / self._y_unit
        age = self._t - np.append(np.asarray(self._age, dtype=np.float64), self._t)
        w = np.power(0.5, age / self.config.half_life_steps) * np.append(np.asarray(self._mult), 1.0)
        pen = np.full(X.shape[1], self.config.ridge * max(float(w.sum()), 1.0))
        pen[0] = 0.0
        Xw = X * w[:, None]
        theta = np.linalg.lstsq(X.T @ Xw + np.diag(pen), Xw.T @ Y, rcond=None)[0]
        resid = Y[-run:] - X[-run:] @ theta
        return float(np.median(np.abs(resid))) < self.config.change_sigma * self._sigma

    def _fit(self) -> None:
        self._since_fit = 0
        X = np.stack(self._x)
        y_raw = np.asarray(self._y)
        self._y_unit = float(np.median(y_raw)) or 1.0
        y = y_raw / self._y_unit
        age = self._t - 1 - np.asarray(self._age, dtype=np.float64)
        w0 = np.power(0.5, age / self.config.half_life_steps) * np.asarray(self._mult)
        pen = np.full(X.shape[1], self.config.ridge * max(float(w0.sum()), 1.0))
        pen[0] = 0.0  # the intercept is not shrunk
        w = w0.copy()
        theta = np.zeros(X.shape[1])
        sigma = float("inf")
        for _ in range(4):
            Xw = X * w[:, None]
            A = X.T @ Xw + np.diag(pen)
            theta = np.linalg.lstsq(A, Xw.T @ y, rcond=None)[0]
            resid = y - X @ theta
            sigma = self._robust_sigma(resid, w0)
            u = np.abs(resid) / (self.config.huber_k * sigma)
            w = w0 * np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
        self._theta = theta
        self._sigma = sigma
        self._a_inv = np.linalg.pinv(X.T @ (X * w0[:, None]) + np.diag(pen))

    @staticmethod
    def _robust_sigma(resid: np.ndarray, weights: np.ndarray) -> float:
        # Weighted median absolute residual, floored so a perfect fit still has a scale.
        order = np.argsort(np.abs(resid))
        cw = np.cumsum(weights[order])
        idx = int(np.searchsorted(cw, 0.5 * cw[-1]))
        mad = float(np.abs(resid)[order][min(idx, len(order) - 1)])
        return max(1.4826 * mad, 1e-3)

    # -- prediction -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return (
            self._theta is not None
            and len(self._y) >= self.config.min_observations
            and len(set(self._tokens)) >= self.config.min_distinct_tokens
        )

    @property
    def relative_sigma(self) -> float:
        """Robust residual scale as a fraction of the median step time (inf before a fit)."""
        return self._sigma

    def predict(self, num_reqs: Any, verify_tokens: Any, context_tokens: Any = 0) -> np.ndarray:
        """Predicted seconds (array). Floored at a tenth of the smallest observed step."""
        if self._theta is None:
            raise RuntimeError("OnlineStepCostModel.predict called before any observation")
        raw = self.design(num_reqs, verify_tokens, context_tokens) @ self._theta * self._y_unit
        floor = 0.1 * min(self._y)
        return np.maximum(raw, floor)

    def snapshot(self) -> dict[str, Any]:
        return {
            "observations": self.observations,
            "window": len(self._y),
            "ready": self.ready,
            "relative_sigma": None if not np.isfinite(self._sigma) else round(self._sigma, 4),
            "changes_detected": self.changes_detected,
            "median_step_ms": round(1000 * float(np.median(self._y)), 4) if self._y else None,
        }
