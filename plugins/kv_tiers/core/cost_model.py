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
            # a plain mean of the first 1/alpha samples, then the EWMA: the first sample (a cold
            # read, a first pass) would otherwise weigh (1 - alpha)^(n - 1) in every early estimate
            a = max(self.alpha, 1.0 / (self.samples + 1))
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


@dataclass(frozen=True)
class PrefillParams:
    fixed_s: float
    """Seconds per pass regardless of size."""
    per_token_s: float
    """Seconds per new token (the linear layers, and the attention of a token to itself)."""
    per_pair_s: float
    """Seconds per (new token, context token) pair: attention, 0 where not shown by the data."""

    def marginal_s(self, context: float) -> float:
        """Seconds of one more new token in a sequence of `context` tokens."""
        return self.per_token_s + self.per_pair_s * max(context, 0.0)


class PrefillCost:
    """Prefill seconds of a pass = fixed + per_token * N + per_pair * A, where N is the pass's new
    tokens and A the sum over its requests of new tokens x sequence length (the query-key pairs that
    attention computes, up to the causal half).

    Recomputing a cached prefix of n tokens in a request of T tokens turns n cached tokens into new
    ones: it costs n * (per_token + per_pair * T), more per token in a long request than in a short
    one. A model linear in N alone charges every token the average slope over the sizes seen, too
    much for a short request (its break-even length comes out low) and too little for a long one.

    Both slopes come from an EWMA least-squares fit on (N, A); the pair term is used only where the
    data show it (`min_t` standard errors above zero, with a positive per-token slope and fixed
    part), otherwise the model is `LinearCost` on N (which then answers `per_pair_s = 0`).
    """

    # features scaled to keep the moments' magnitudes close (A reaches 1e7 pairs per pass)
    _SN = 1e-3
    _SA = 1e-6

    def __init__(self, prior: CostPrior, alpha: float = 0.1, min_samples: int = 3, min_t: float = 3.0) -> None:
        self.linear = LinearCost(prior, alpha, min_samples, min_t)
        self.alpha = alpha
        self.min_t = min_t
        self.samples = 0
        self._m = [0.0] * 9  # n, a, nn, aa, na, y, ny, ay, yy
        self._lock = threading.Lock()

    def observe(self, tokens: float, seconds: float, pairs: float | None = None) -> None:
        """A pass of `tokens` new tokens took `seconds`; `pairs` = sum of new x sequence length over
        its requests (None: unknown, only the linear model learns)."""
        self.linear.observe(tokens, seconds)
        if pairs is None or tokens <= 0 or seconds < 0 or pairs < 0:
            return
        n, a, y = tokens * self._SN, pairs * self._SA, seconds
        with self._lock:
            w = self.alpha if self.samples else 1.0
            for i, v in enumerate((n, a, n * n, a * a, n * a, y, n * y, a * y, y * y)):
                self._m[i] += w * (v - self._m[i])
            self.samples += 1

    def params(self) -> PrefillParams:
        lin = self.linear.params()
        fallback = PrefillParams(lin.fixed_s, lin.per_unit_s, 0.0)
        with self._lock:
            if self.samples < max(self.linear.min_samples, 4):
                return fallback
            mn, ma, mnn, maa, mna, my, mny, may, myy = self._m
            samples = self.samples
        vnn, vaa, vna = mnn - mn * mn, maa - ma * ma, mna - mn * ma
        gn, ga, vyy = mny - mn * my, may - ma * my, myy - my * my
        det = vnn * vaa - vna * vna
        if vnn <= 0 or vaa <= 0 or det <= 1e-9 * vnn * vaa:
            return fallback  # sizes and pairs move together (or not at all): no separate pair term
        b = (gn * vaa - ga * vna) / det
        c = (ga * vnn - gn * vna) / det
        fixed = my - b * mn - c * ma
        if b <= 0 or c <= 0 or fixed < 0:
            return fallback
        n_eff = min(float(samples), (2.0 - self.alpha) / self.alpha)
        if n_eff > 3:
            resid = max(vyy - b * gn - c * ga, 0.0)
            se2 = resid / (n_eff - 3.0) * vnn / det
            if c * c < self.min_t * self.min_t * se2:
                return fallback
        return PrefillParams(fixed, b * self._SN, c * self._SA)
