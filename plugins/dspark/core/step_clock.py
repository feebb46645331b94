"""Layer: plugin core (no SGLang import). Turning planning calls into step-time observations.

SGLang plans one verify budget per decode step. Under the overlap scheduler the host plans step
n+1 while the device runs step n, so in steady state the interval between two consecutive
planning calls is the period of the decode pipeline: the step time the budget should price.
The clock attributes each interval to the features of the step planned at its start and drops
intervals broken by a prefill/extend step or longer than `max_gap_s` (idle, preemption). It is
an estimate (it includes host-side time, which is part of what a step costs); an adapter with
exact device timings can call `OnlineStepCostModel.observe` directly instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kllm_plugins.plugins.dspark.core.cost_model import StepFeatures


@dataclass(frozen=True)
class StepObservation:
    features: StepFeatures
    seconds: float


class StepClock:
    def __init__(self, max_gap_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_gap_s <= 0:
            raise ValueError(f"max_gap_s must be > 0, got {max_gap_s}")
        self.max_gap_s = max_gap_s
        self._clock = clock
        self._pending: StepFeatures | None = None
        self._pending_t = 0.0
        self.dropped = 0

    def on_plan(self, features: StepFeatures, now: float | None = None) -> StepObservation | None:
        """A decode step was planned with `features`; returns the previous step's observation."""
        now = self._clock() if now is None else now
        obs = None
        if self._pending is not None:
            dt = now - self._pending_t
            if 0 < dt <= self.max_gap_s:
                obs = StepObservation(self._pending, dt)
            else:
                self.dropped += 1
        self._pending = features
        self._pending_t = now
        return obs

    def on_non_decode(self) -> None:
        """A prefill/extend step ran: the interval in flight does not time a verify step."""
        if self._pending is not None:
            self.dropped += 1
        self._pending = None
