"""Quantiles, spread and ratios for benchmark figures. SGLang-free, numpy-free.

`quantile` is `numpy.percentile(xs, 100 * q)` with numpy's default (linear) method: the value at
rank `(n - 1) * q` of the sorted samples, interpolated between its neighbours. Every benchmark uses
it, so a P99 means the same thing in every result file.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Sequence


def _clean(xs: Iterable[float], what: str) -> list[float]:
    out = sorted(float(x) for x in xs)
    if not out:
        raise ValueError(f"{what} of no samples")
    if any(math.isnan(x) for x in out):
        raise ValueError(f"{what} of samples containing NaN")
    return out


def quantile(xs: Iterable[float], q: float) -> float:
    """numpy.percentile(xs, 100 * q) (linear method); q in [0, 1]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q} outside [0, 1] (for a percentile p use percentile(xs, p))")
    s = _clean(xs, "quantile")
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentile(xs: Iterable[float], p: float) -> float:
    """numpy.percentile(xs, p) (linear method); p in [0, 100]."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile p={p} outside [0, 100]")
    return quantile(xs, p / 100.0)


def distribution(xs: Sequence[float], quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """mean, the given quantiles (as p50, p90, p99, ...), min, max and n of one sample set."""
    s = _clean(xs, "distribution")
    out: dict[str, float] = {"mean": statistics.fmean(s)}
    for q in quantiles:
        out[f"p{100 * q:g}".replace(".", "_")] = quantile(s, q)
    out.update(min=s[0], max=s[-1], n=len(s))
    return out


def spread(repeats: Sequence[float]) -> dict[str, Any]:
    """A figure over repeats: median with min/max, p10/p90 and the repeats themselves (in run order)."""
    s = _clean(repeats, "spread")
    return {"median": quantile(s, 0.5), "min": s[0], "max": s[-1], "p10": quantile(s, 0.1),
            "p90": quantile(s, 0.9), "repeats": [float(x) for x in repeats]}


def ratio_of_medians(ours: Sequence[float], base: Sequence[float], paired: bool | None = None) -> dict[str, Any]:
    """median(ours) / median(base), with a spread.

    `paired` (default: when both have the same length, i.e. interleaved repeats): the spread is the
    min/max of the per-repeat ratios ours[i] / base[i]. Unpaired: the extremes min(ours) / max(base)
    and max(ours) / min(base), a bound on any pairing.
    """
    o, b = list(map(float, ours)), list(map(float, base))
    if not o or not b:
        raise ValueError("ratio of medians needs samples on both sides")
    mb = quantile(b, 0.5)
    if mb == 0:
        raise ValueError("ratio of medians: the baseline's median is 0")
    paired = len(o) == len(b) if paired is None else paired
    if paired:
        if len(o) != len(b):
            raise ValueError(f"paired ratio needs as many repeats on each side ({len(o)} vs {len(b)})")
        if any(x == 0 for x in b):
            raise ValueError("paired ratio: a baseline repeat is 0")
        per = [x / y for x, y in zip(o, b)]
        lo, hi = min(per), max(per)
    else:
        if min(b) == 0:
            raise ValueError("unpaired ratio: the baseline's minimum is 0")
        per = []
        lo, hi = min(o) / max(b), max(o) / min(b)
    out: dict[str, Any] = {"ratio": quantile(o, 0.5) / mb, "min": lo, "max": hi, "paired": paired}
    if per:
        out["per_repeat"] = per
    return out


def fmt_spread(s: dict[str, Any], digits: int = 3, scale: float = 1.0) -> str:
    """'median [min-max]' of a spread() or ratio_of_medians() dict."""
    mid = s["median"] if "median" in s else s["ratio"]
    return f"{mid * scale:.{digits}f} [{s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f}]"
