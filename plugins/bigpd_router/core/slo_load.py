"""Layer: core (no SGLang import). SLO Load per side of the PD split.

Load_P = max(TTFT_pred, TTFT_actual) / TTFT_target and Load_D = max(TPOT_pred, TPOT_actual) /
TPOT_target. Predictions come from the backlog the router has put on each instance (and what
the instance reports) divided by measured service rates; actuals are recent observations.
A Load above 1 means the side is (or is about to be) missing its SLO.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from kllm_plugins.plugins.bigpd_router.core.registry import Instance


class RateEstimator:
    """Exponentially weighted moving average that starts from a prior."""

    def __init__(self, initial: float, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.value = float(initial)
        self.alpha = alpha
        self.samples = 0

    def update(self, sample: float) -> float:
        if not math.isfinite(sample) or sample < 0:
            return self.value
        self.value = sample if self.samples == 0 else self.alpha * sample + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


class WindowStat:
    """Observations of the last `window_s` seconds; mean and quantiles, old ones fall out."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._items: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, value: float) -> None:
        self._items.append((self._clock(), value))
        self._trim()

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._items and self._items[0][0] < horizon:
            self._items.popleft()

    def values(self) -> list[float]:
        self._trim()
        return [v for _, v in self._items]

    def mean(self) -> float:
        vals = self.values()
        return sum(vals) / len(vals) if vals else 0.0

    def quantile(self, q: float) -> float:
        vals = sorted(self.values())
        if not vals:
            return 0.0
        return vals[min(len(vals) - 1, int(q * len(vals)))]

    def __len__(self) -> int:
        return len(self.values())


def backlog_tokens(inst: Instance) -> int:
    """Prompt tokens ahead of a new request: the larger of what we routed and what it reports."""
    return max(inst.pending_prefill_tokens, inst.reported.waiting_tokens)


def ttft_pred(inst: Instance, prompt_tokens: int) -> float:
    """Predicted TTFT of a new `prompt_tokens` request sent to `inst` now."""
    rate = max(inst.prefill_rate.value, 1e-6)
    return (backlog_tokens(inst) + prompt_tokens) / rate


def decode_batch(inst: Instance) -> int:
    return max(inst.decoding, inst.reported.running_reqs)


DECODE_BATCH_KNEE = 16.0
"""Batch size at which a decode step costs twice the single-request step (a coarse linear model)."""


def batch_factor(batch: float, knee: float = DECODE_BATCH_KNEE) -> float:
    return 1.0 + max(0.0, batch) / knee


def tpot_pred(inst: Instance, extra: int = 1) -> float:
    """Predicted TPOT on `inst` with `extra` more decoding requests.

    `inst.tpot` holds the single-request TPOT: each observation made at batch n is divided by
    batch_factor(n) before it is averaged in (see `observe_tpot`), so predictions grow with the batch.
    """
    return inst.tpot.value * batch_factor(decode_batch(inst) + extra)


def observe_tpot(inst: Instance, tpot_s: float, batch: int) -> None:
    inst.tpot.update(tpot_s / batch_factor(batch))


def measured_tpot(inst: Instance, peers: Iterable[Instance]) -> float | None:
    """TPOT of `inst` at its current batch from measurements: its own, else the median of its
    peers' (an instance that has only answered whole responses has none); None when nobody has one."""
    if inst.tpot.samples:
        return tpot_pred(inst, extra=0)
    known = sorted(p.tpot.value for p in peers if p.tpot.samples)
    if not known:
        return None
    return known[len(known) // 2] * batch_factor(decode_batch(inst))


@dataclass(frozen=True)
class PoolLoad:
    pred: float
    actual: float
    target: float
    instances: int
    floor: float = 0.0
    """The part of the latency more instances cannot remove (a lone request's TTFT or TPOT)."""

    @property
    def load(self) -> float:
        return max(self.pred, self.actual) / self.target

    @property
    def pred_load(self) -> float:
        return self.pred / self.target

    @property
    def floor_load(self) -> float:
        return self.floor / self.target

    def load_with(self, n: int, pred_only: bool = False) -> float:
        """Load if the pool had `n` instances for the same work: only the part above the floor
        (queueing, batching) is shared out over the instances."""
        if n <= 0:
            return math.inf
        cur = self.pred if pred_only else max(self.pred, self.actual)
        if not self.instances:
            return cur / self.target
        floor = min(self.floor, cur)
        return (floor + (cur - floor) * self.instances / n) / self.target


def prefill_pool_load(members: Iterable[Instance], actual: WindowStat, target_s: float,
                      typical_prompt_tokens: int) -> PoolLoad:
    """Load_P of a pool: mean predicted TTFT of a typical request over its members."""
    members = list(members)
    if not members:
        return PoolLoad(pred=0.0, actual=actual.mean(), target=target_s, instances=0)
    pred = sum(ttft_pred(m, typical_prompt_tokens) for m in members) / len(members)
    floor = sum(typical_prompt_tokens / max(m.prefill_rate.value, 1e-6) for m in members) / len(members)
    return PoolLoad(pred=pred, actual=actual.mean(), target=target_s, instances=len(members), floor=floor)


def decode_pool_load(members: Iterable[Instance], actual: WindowStat, target_s: float) -> PoolLoad:
    """Load_D of a pool: mean predicted TPOT over its members with one more request each."""
    members = list(members)
    if not members:
        return PoolLoad(pred=0.0, actual=actual.mean(), target=target_s, instances=0)
    busy = [m for m in members if decode_batch(m) > 0]
    pred = sum(tpot_pred(m) for m in busy) / len(members) if busy else 0.0
    floor = sum(m.tpot.value * batch_factor(1) for m in members) / len(members)
    return PoolLoad(pred=pred, actual=actual.mean(), target=target_s, instances=len(members), floor=floor)


class TokenEstimator:
    """Characters -> tokens, learning the ratio from the prompt_tokens instances report back."""

    def __init__(self, chars_per_token: float = 4.0) -> None:
        self._cpt = RateEstimator(initial=chars_per_token, alpha=0.1)

    def estimate(self, chars: int) -> int:
        return max(1, int(chars / max(self._cpt.value, 0.5)))

    def observe(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self._cpt.update(chars / tokens)
