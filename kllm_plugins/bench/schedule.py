"""Arrival schedules (offsets in seconds from the start of a load step). SGLang-free.

Every schedule is seeded, so every setup of one benchmark replays the same arrivals. `scaled=True`
draws one unit-rate schedule per seed and divides it by the rate, so each step of a rate ladder
replays the same pattern faster.
"""
from __future__ import annotations

import random
from typing import Iterable, Sequence


def _check(n: int, rate: float) -> None:
    if n < 0:
        raise ValueError(f"schedule of {n} requests")
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 req/s, got {rate}")


def constant(n: int, rate: float) -> list[float]:
    """Request i at i / rate."""
    _check(n, rate)
    return [i / rate for i in range(n)]


def poisson(n: int, rate: float, seed: int, scaled: bool = False) -> list[float]:
    """Poisson arrivals (exponential gaps, mean 1 / rate); the first at 0."""
    _check(n, rate)
    if scaled:
        return [t / rate for t in poisson(n, 1.0, seed)]
    rng = random.Random(seed * 1_000_003 + int(rate * 1000))
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def gamma(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Gamma-distributed gaps with mean 1 / rate and coefficient of variation `cv` (1 = Poisson,
    above 1 burstier), as `sglang.bench_serving --burstiness 1/cv^2` draws them."""
    _check(n, rate)
    if not cv > 0:
        raise ValueError(f"gamma schedule needs cv > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    rng = random.Random(seed * 7_000_003 + int(rate * 1000))
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return out


def from_timestamps(timestamps_ms: Iterable[float], slowdown: float = 1.0) -> list[float]:
    """A trace's own arrivals (ms timestamps), relative to its first, times `slowdown`
    (`sglang.bench_serving --mooncake-slowdown-factor`)."""
    ts = list(timestamps_ms)
    if not slowdown > 0:
        raise ValueError(f"slowdown must be > 0, got {slowdown}")
    if not ts:
        return []
    t0 = min(ts)
    return [(t - t0) / 1000.0 * slowdown for t in ts]


def assign(n: int, servers: int, seed: int) -> list[int]:
    """A seeded server index per request, the same for every setup and load step."""
    if servers < 1:
        raise ValueError(f"assign needs at least one server, got {servers}")
    rng = random.Random(seed)
    return [rng.randrange(servers) for _ in range(n)]


def offered_rate(offsets_s: Sequence[float]) -> float:
    """Requests per second the schedule offers ((n - 1) / span); 0 for fewer than two."""
    if len(offsets_s) < 2:
        return 0.0
    span = max(offsets_s) - min(offsets_s)
    return (len(offsets_s) - 1) / span if span > 0 else float("inf")
