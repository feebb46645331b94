"""Layer: core (no SGLang import). Per-request choice of instances.

Plain mode picks one instance; PD mode picks a prefill instance and a decode instance
independently for every request (no fixed groups):
- prefill (and plain): the predicted TTFT if the request went there, where the prompt tokens the
  instance probably already caches (approximate prefix tree) do not count. Cache affinity and
  load are therefore weighed in the same unit, seconds against the TTFT target.
- decode: predicted TPOT with one more request against the TPOT target, plus a penalty when the
  instance is short of free KV, plus a small transfer cost when it is on another host than the
  prefill instance.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from kllm_plugins.plugins.bigpd_router.core.prefix_tree import Prompt, PrefixTree
from kllm_plugins.plugins.bigpd_router.core.registry import Health, Instance
from kllm_plugins.plugins.bigpd_router.core.slo_load import backlog_tokens, tpot_pred

KV_LOW_FREE = 0.1
KV_PENALTY = 1.0
REMOTE_TRANSFER_COST = 0.05
TIE_EPS = 0.02
"""Scores (in units of the SLO target) closer than this count as equal."""
MIN_RATE_SAMPLES = 3
"""Below this many measurements an instance's prefill rate is not judged on its own: it gets the
better of its own and its peers' median. A rate only changes when the instance serves, so one slow
first request (a cold cache, a loaded host) would otherwise keep a new instance from ever being
picked again while its peers have room."""


class NoInstance(RuntimeError):
    """No routable instance of the wanted role is left to try."""


@dataclass(frozen=True)
class PrefillChoice:
    instance: Instance
    cached_fraction: float
    """Part of the prompt the instance probably holds (KV events, or the prefix tree)."""
    score: float


def _usable(cands: Sequence[Instance], exclude: frozenset[str]) -> list[Instance]:
    """Healthy candidates; if none is left, the unhealthy ones ("panic mode"): a health check that
    timed out on a busy instance must not turn into a refusal of every request."""
    healthy = [c for c in cands if c.routable and c.url not in exclude]
    if healthy:
        return healthy
    return [c for c in cands if c.health is Health.UNHEALTHY and c.url not in exclude]


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


class Picker:
    def __init__(self, policy: str, tree: PrefixTree, ttft_target_s: float, tpot_target_s: float,
                 affinity_weight: float = 1.0) -> None:
        self.policy = policy
        self.tree = tree
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.affinity_weight = affinity_weight
        self._rr: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()

    def _round_robin(self, cands: Sequence[Instance], key: str = "prefill") -> Instance:
        """Rotation with one counter per pool, so prefill and decode picks do not interfere."""
        with self._lock:
            i = next(self._rr.setdefault(key, itertools.count()))
        return sorted(cands, key=lambda c: c.url)[i % len(cands)]

    def prefill_score(self, inst: Instance, prompt_tokens: int, matched_frac: float,
                      rate: float | None = None) -> float:
        """Predicted TTFT on `inst` / TTFT target, with the probably-cached part of the prompt free."""
        cached = min(1.0, self.affinity_weight * matched_frac)
        work = backlog_tokens(inst) + prompt_tokens * (1.0 - cached)
        return work / max(rate or inst.prefill_rate.value, 1e-6) / self.ttft_target_s

    @staticmethod
    def _rates(cands: Sequence[Instance]) -> dict[str, float]:
        """Measured prefill rates. An instance not measured yet borrows the median of its peers (of
        those measured MIN_RATE_SAMPLES times, if any); one measured fewer times gets the better of
        its own rate and that median."""
        trusted = sorted(c.prefill_rate.value for c in cands if c.prefill_rate.samples >= MIN_RATE_SAMPLES)
        measured = trusted or sorted(c.prefill_rate.value for c in cands if c.prefill_rate.samples)
        fallback = measured[len(measured) // 2] if measured else None
        out: dict[str, float] = {}
        for c in cands:
            own = c.prefill_rate
            if fallback is None or own.samples >= MIN_RATE_SAMPLES:
                out[c.url] = own.value
            else:
                out[c.url] = max(own.value, fallback) if own.samples else fallback
        return out

    def pick_prefill(self, cands: Sequence[Instance], prompt: Prompt, prompt_tokens: int,
                     exclude: frozenset[str] = frozenset(),
                     known: Mapping[str, float] | None = None) -> PrefillChoice:
        """`known`: url -> cached fraction of the prompt from the instance's own KV events; it replaces
        the approximate prefix tree for the instances it names."""
        cands = _usable(cands, exclude)
        if not cands:
            raise NoInstance("no routable prefill/plain instance")
        if self.policy == "round_robin":
            return PrefillChoice(self._round_robin(cands), 0.0, 0.0)
        frac: dict[str, float] = {}
        if self.policy == "slo_affinity":
            if known is None or any(c.url not in known for c in cands):
                total = self.tree.blocks_of(prompt)
                if total:
                    frac = {url: n / total for url, n in self.tree.match(prompt).items()}
            if known:
                frac.update(known)
        rates = self._rates(cands)
        scored = [(self.prefill_score(c, prompt_tokens, frac.get(c.url, 0.0), rates[c.url]), c) for c in cands]
        best = min(score for score, _ in scored)
        # near-equal predictions are a tie: the longer cached prefix wins, then fewer requests in
        # flight, then rotation, so idle instances share new prefixes instead of piling on one
        tied = [c for score, c in scored if score <= best + TIE_EPS]
        top = max(frac.get(c.url, 0.0) for c in tied)
        tied = [c for c in tied if frac.get(c.url, 0.0) == top]
        low = min(c.in_flight for c in tied)
        tied = [c for c in tied if c.in_flight == low]
        chosen = tied[0] if len(tied) == 1 else self._round_robin(tied)
        score = next(sc for sc, c in scored if c is chosen)
        return PrefillChoice(chosen, frac.get(chosen.url, 0.0), score)

    def decode_score(self, inst: Instance, prefill: Instance | None) -> float:
        score = tpot_pred(inst) / self.tpot_target_s
        if inst.free_kv_fraction() < KV_LOW_FREE:
            score += KV_PENALTY
        if prefill is not None and _host(prefill.url) != _host(inst.url):
            score += REMOTE_TRANSFER_COST
        return score

    def pick_decode(self, cands: Sequence[Instance], prefill: Instance | None,
                    exclude: frozenset[str] = frozenset()) -> Instance:
        cands = _usable(cands, exclude)
        if not cands:
            raise NoInstance("no routable decode instance")
        if self.policy == "round_robin":
            return self._round_robin(cands, "decode")
        return min(cands, key=lambda c: (self.decode_score(c, prefill), c.in_flight, c.url))

    def routed(self, prompt: Prompt, inst: Instance) -> None:
        """Remember that `prompt` went to `inst` (affinity for later requests)."""
        if self.policy == "slo_affinity":
            self.tree.insert(prompt, inst.url)
