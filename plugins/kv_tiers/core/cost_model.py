"""Layer: plugin core (no SGLang import). Online cost models learned from measured transfers.

`LinearCost` learns `seconds = fixed + per_unit * units` from observed (units, seconds) pairs
with exponentially weighted moments (an EWMA least-squares fit), so it follows a tier or a
prefill speed that drifts (a busier disk, a longer context) without keeping a history. Until
`min_samples` observations arrive it answers from a prior.

The slope is used only where the sizes seen vary enough, against the timing noise, to show it:
prefill is mostly timed on full chunks of one size, and a slope fitted to near-identical sizes with
noisy timings can come out near zero (a prefill speed 10-50x the true one, measured on CPU) or far too
steep. A slope within `min_t` standard errors of zero is not trusted; the model then charges all the
time per unit (mean seconds / mean units), which is right at the sizes actually seen.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CostPrior:
    fixed_s: float
    """Seconds per operation regardless of size (latency)."""
    per_unit_s: float
    """Seconds per unit (per byte for a tier, per token for prefill)."""


class LinearCost:
    """EWMA least-squares fit of seconds against units.

    alpha:        weight of the newest sample (0 < alpha <= 1).
    min_samples:  samples needed before the fit replaces the prior.
    min_t:        how many standard errors the fitted slope must stand above zero to be used.
    """

    def __init__(self, prior: CostPrior, alpha: float = 0.1, min_samples: int = 3, min_t: float = 3.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if prior.fixed_s < 0 or prior.per_unit_s <= 0:
            raise ValueError(f"prior must have fixed_s >= 0 and per_unit_s > 0, got {prior}")
        self.prior = prior
        self.alpha = alpha
        self.min_samples = min_samples
        self.min_t = min_t
        self.samples = 0
        self._mx = self._my = self._mxx = self._mxy = self._myy = 0.0
        self._lock = threading.Lock()

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds < 0:
            return
        with self._lock:
            a = self.alpha if self.samples else 1.0
            self._mx += a * (units - self._mx)
            self._my += a * (seconds - self._my)
            self._mxx += a * (units * units - self._mxx)
            self._mxy += a * (units * seconds - self._mxy)
            self._myy += a * (seconds * seconds - self._myy)
            self.samples += 1

    def params(self) -> CostPrior:
        """(fixed_s, per_unit_s) now: the fit once warm, otherwise the prior."""
        with self._lock:
            if self.samples < self.min_samples:
                return self.prior
            var = self._mxx - self._mx * self._mx
            # Sizes that barely vary give no slope: charge everything per unit.
            if var <= 1e-12 * max(self._mxx, 1e-300):
                return self._per_unit_only()
            cov = self._mxy - self._mx * self._my
            slope = cov / var
            if slope <= 0 or not self._slope_shown(var, cov, slope):
                return self._per_unit_only()
            fixed = self._my - slope * self._mx
            if fixed < 0:
                return self._per_unit_only()
            return CostPrior(fixed, slope)

    def _per_unit_only(self) -> CostPrior:
        """No fixed part: all the time charged per unit at the sizes seen (lock held)."""
        return CostPrior(0.0, max(self._my / self._mx, 1e-15))

    def _slope_shown(self, var: float, cov: float, slope: float) -> bool:
        """Whether the slope stands `min_t` standard errors above zero (lock held). The moments are
        exponentially weighted, so the fit rests on about (2 - alpha) / alpha samples at most."""
        resid = max(self._myy - self._my * self._my - cov * slope, 0.0)
        n_eff = min(float(self.samples), (2.0 - self.alpha) / self.alpha)
        if n_eff <= 2:
            return True  # too few samples to judge; min_samples decides when to start
        se2 = resid / ((n_eff - 2.0) * var)
        return slope * slope >= self.min_t * self.min_t * se2

    def seconds(self, units: float) -> float:
        p = self.params()
        return p.fixed_s + p.per_unit_s * units

    def rate(self) -> float:
        """Units per second of the marginal unit (bandwidth or tokens/s)."""
        return 1.0 / self.params().per_unit_s

    @property
    def warm(self) -> bool:
        return self.samples >= self.min_samples
