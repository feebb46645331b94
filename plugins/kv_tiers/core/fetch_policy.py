"""Layer: plugin core (no SGLang import). Fetch a cached prefix from L2/L3 or recompute it.

Loading `n` cached tokens from a tier costs the tier's latency plus `n * bytes_per_token`
over its bandwidth (an L3 hit also crosses L2 on its way to the device); recomputing them costs
the instance's prefill time for `n` tokens. Both are learned online (`cost_model.LinearCost`,
`cost_model.PrefillCost`). Recomputing costs more per token in a longer request (attention), so the
prefill model has a per-token and a per-(token, context token) term, and a decision may be given the
request's length (`context`). A hit is fetched only when fetching is cheaper by `margin`; since the
costs grow monotonically with `n`, that is equivalent to a minimum hit length per tier and request
length, which is what HiCache's prefetch threshold takes. A slow tier therefore stops being used,
and a tier is re-measured now and then (`explore_every`) so that it can come back when it gets
faster.

An L3 fetch costs the request more than the page reads: the request waits for its whole prefetch
(HiCache's storage query, the reads, the hand-offs between its threads and the scheduler's next
look), and a lookup that finds nothing costs that round trip too. `observe_prefetch_wait` learns
this overhead (measured wait minus the modelled read time, an EWMA) and it is charged to every L3
fetch as extra latency, so the break-even length rises when the round trip is slow (a loaded
machine) instead of staying at the bare read latency of one page.

That round trip depends on the load: behind a queue, HiCache's storage thread and the scheduler's
passes are slower, and waits of 50-90 ms were measured at 14-16 req/s against 2-10 ms with one
request in flight. One average over both kept a loaded period's waits after the load had gone
(only fetched hits are observed, and the high estimate refused them), so the next idle requests
recomputed hits a fast disk would have served. The overhead is therefore learned separately for
a busy server (requests waiting) and an idle one, and each decision uses the one for the state it
is taken in (`busy`).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal

from kllm_plugins.plugins.kv_tiers.core.cost_model import CostPrior, LinearCost, PrefillCost

Tier = Literal["l2", "l3"]


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    tier: Tier
    tokens: int
    fetch_s: float
    recompute_s: float
    reason: str


class FetchOrRecompute:
    """Per-instance decision rule, fed with measured transfers and prefill passes.

    bytes_per_token:  KV bytes of one token across all layers on this rank.
    margin:           fetch only when fetch_s * margin < recompute_s (>= 1).
    explore_every:    every N-th refused decision of a tier fetches anyway, to re-measure it
                      (0 disables exploration).
    trust_samples:    a tier measured on fewer transfers than this (but at least one) is not refused:
                      its refused decisions fetch anyway until it has that many. A few slow first
                      reads (a cold file, a busy moment) otherwise shut a tier out for a whole
                      `explore_every` refusals (measured: 5 samples put a local disk at 0.9 MB/s, 700x
                      below its rate, and the server recomputed its L3 hits for a 72-request cell).
    """

    def __init__(
        self,
        bytes_per_token: int,
        *,
        l2_prior: CostPrior,
        l3_prior: CostPrior,
        prefill_prior: CostPrior,
        margin: float = 1.2,
        alpha: float = 0.1,
        explore_every: int = 50,
        trust_samples: int = 32,
    ) -> None:
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        if margin < 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        self.bytes_per_token = bytes_per_token
        self.margin = margin
        self.explore_every = explore_every
        self.trust_samples = trust_samples
        self.tiers: dict[str, LinearCost] = {
            "l2": LinearCost(l2_prior, alpha),
            "l3": LinearCost(l3_prior, alpha),
        }
        self.prefill = PrefillCost(prefill_prior, alpha)
        self.alpha = alpha
        self.l3_overhead_s = 0.0  # EWMA of (a request's prefetch wait - modelled read time), idle server
        self.l3_waits = 0
        self.l3_overhead_busy_s = 0.0  # the same with requests waiting (until one is seen, the idle one applies)
        self.l3_waits_busy = 0
        self._refused: dict[str, int] = {"l2": 0, "l3": 0}
        self._lock = threading.Lock()

    # -- learning ----------------------------------------------------------------------------

    def observe_transfer(self, tier: Tier, nbytes: int, seconds: float) -> None:
        self.tiers[tier].observe(nbytes, seconds)

    def observe_prefetch_wait(self, loaded_bytes: int, seconds: float, busy: bool = False) -> None:
        """A request waited `seconds` for its L3 prefetch, which loaded `loaded_bytes` (0: a miss),
        on a server with (`busy`) or without requests waiting."""
        if seconds < 0:
            return
        read = self.tiers["l3"].seconds(loaded_bytes) if loaded_bytes > 0 else 0.0
        extra = max(0.0, seconds - read)
        with self._lock:
            if busy:
                a = self.alpha if self.l3_waits_busy else 1.0
                self.l3_overhead_busy_s += a * (extra - self.l3_overhead_busy_s)
                self.l3_waits_busy += 1
            else:
                a = self.alpha if self.l3_waits else 1.0
                self.l3_overhead_s += a * (extra - self.l3_overhead_s)
                self.l3_waits += 1

    def l3_overhead(self, busy: bool = False) -> float:
        """The learned prefetch round trip beyond the reads, for a busy or an idle server."""
        return self.l3_overhead_busy_s if busy and self.l3_waits_busy else self.l3_overhead_s

    def observe_prefill(self, tokens: int, seconds: float, pairs: int | None = None) -> None:
        """A prefill pass of `tokens` new tokens took `seconds`; `pairs`: the sum over its requests of
        new tokens x sequence length (None: unknown)."""
        self.prefill.observe(tokens, seconds, pairs)

    # -- deciding ----------------------------------------------------------------------------

    def fetch_seconds(self, tier: Tier, tokens: int, busy: bool = False) -> float:
        nbytes = tokens * self.bytes_per_token
        s = self.tiers["l2"].seconds(nbytes)
        if tier == "l3":
            s += self.tiers["l3"].seconds(nbytes) + self.l3_overhead(busy)
        return s

    def recompute_seconds(self, tokens: int, context: int = 0) -> float:
        """Recomputing `tokens` cached tokens of a request of `context` tokens (at least `tokens`);
        the pass and its fixed cost run anyway."""
        return tokens * self.prefill.params().marginal_s(max(context, tokens))

    def decide(self, tier: Tier, tokens: int, context: int = 0, busy: bool = False) -> FetchDecision:
        if tokens <= 0:
            return FetchDecision(False, tier, tokens, 0.0, 0.0, "empty")
        f = self.fetch_seconds(tier, tokens, busy)
        r = self.recompute_seconds(tokens, context)
        if f * self.margin < r:
            return FetchDecision(True, tier, tokens, f, r, "fetch_cheaper")
        if self.explore_refused(tier):
            return FetchDecision(True, tier, tokens, f, r, "explore")
        return FetchDecision(False, tier, tokens, f, r, "recompute_cheaper")

    def explore_refused(self, tier: Tier) -> bool:
        """Count one refused fetch from `tier`; True on every `explore_every`-th, which is fetched
        anyway so that a tier measured slow is re-measured and can come back when it gets faster,
        and on every one while the tier's measurement rests on fewer than `trust_samples` transfers."""
        with self._lock:
            self._refused[tier] += 1
            if self.explore_every <= 0:
                return False
            if 0 < self.tiers[tier].samples < self.trust_samples:
                return True
            return self._refused[tier] % self.explore_every == 0

    def min_fetch_tokens(self, tier: Tier, context: int = 0, busy: bool = False) -> float:
        """Smallest hit (tokens) worth fetching from `tier` in a request of `context` tokens (0:
        unknown, the hit alone) on a busy or idle server; `math.inf` when none is."""
        b = self.bytes_per_token
        l2 = self.tiers["l2"].params()
        fixed = l2.fixed_s
        per_tok = l2.per_unit_s * b
        if tier == "l3":
            l3 = self.tiers["l3"].params()
            fixed += l3.fixed_s + self.l3_overhead(busy)
            per_tok += l3.per_unit_s * b
        pre = self.prefill.params()
        m_fixed, m_tok = self.margin * fixed, self.margin * per_tok
        gain = pre.marginal_s(context) - m_tok  # per hit token, while the hit is within `context`
        if gain > 0:
            n = m_fixed / gain
            if pre.per_pair_s <= 0 or n < context:
                return math.floor(n) + 1
        if pre.per_pair_s <= 0:
            return math.inf
        # a hit longer than `context` is the request: n * (per_token + per_pair * n) > margin * fetch(n)
        b = pre.per_token_s - m_tok
        n = (-b + math.sqrt(b * b + 4.0 * pre.per_pair_s * m_fixed)) / (2.0 * pre.per_pair_s)
        return math.floor(max(n, context)) + 1

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, cost in self.tiers.items():
            p = cost.params()
            out[f"{name}_bandwidth_bytes_per_s"] = 1.0 / p.per_unit_s
            out[f"{name}_latency_s"] = p.fixed_s
            out[f"{name}_samples"] = float(cost.samples)
            out[f"{name}_min_fetch_tokens"] = self.min_fetch_tokens(name)  # type: ignore[arg-type]
        out["l3_prefetch_overhead_s"] = self.l3_overhead_s
        out["l3_prefetch_waits"] = float(self.l3_waits)
        out["l3_prefetch_overhead_busy_s"] = self.l3_overhead_busy_s
        out["l3_prefetch_waits_busy"] = float(self.l3_waits_busy)
        out["l3_min_fetch_tokens_busy"] = self.min_fetch_tokens("l3", busy=True)
        pre = self.prefill.params()
        out["prefill_tokens_per_s"] = 1.0 / pre.per_token_s
        out["prefill_s_per_pair"] = pre.per_pair_s
        out["prefill_samples"] = float(self.prefill.linear.samples)
        return out
