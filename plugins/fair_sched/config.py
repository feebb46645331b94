"""Layer: plugin config (no SGLang import). Options of the fair_sched plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.plugins.fair_sched.core.quota import QuotaParams

LOOP_ACTIONS = ("finish", "retract")


@dataclass(frozen=True)
class FairSchedConfig:
    budget_tokens: int = 0
    """New KV tokens per scheduler pass; 0: SGLang's --chunked-prefill-size."""
    base_quota_tokens: int = 0
    """Tokens a long request prefills before its first yield; 0: one budget."""
    quota_growth: float = 1.5
    """Quota multiplier after each yield (>= 1)."""
    max_quota_tokens: int = 0
    """Largest turn quota; 0: four budgets."""
    max_yields: int = 64
    """Yields after which a long request never yields again."""
    long_min_share: float = 0.25
    """Fraction of the pass budget the active long request keeps when it runs."""
    decode_every_chunks: int = 0
    """While requests decode, a long prefill sits out one pass (a decode step) after this many chunks; 0: never."""
    decode_interval_s: float = 0.0
    """With > 0, a decode step also waits until the last decode is this many seconds old (0: chunk count only)."""
    busy_decode_reqs: int = 0
    """While at least this many requests decode, a decode step comes after every long chunk; 0: off."""
    decode_max_gap_s: float = 0.0
    """With > 0, a decode step also comes after any long chunk once the last decode is this old; 0: off."""
    decode_share: float = 0.04
    """With > 0, while prefills wait a decode step comes once the prefill time since the last is (1 - share) / share decode steps."""
    decode_time_share: float = 0.0
    """With > 0, while prompts wait decode steps take at least this share of the time since they began waiting, several in a row when behind; 0: off."""
    short_extra_tokens: int = -1
    """Extra pass tokens for earlier-key requests riding beside the partial prefill; -1: three budgets; 0: off."""
    age_weight: float = 32.0
    """Order key = prefill tokens processed at arrival + age_weight x uncached prompt, smallest first (0: FCFS)."""
    mixed_decode: bool = False
    """Running requests decode one token inside every prefill pass (SGLang's mixed chunk), so prefills never stall them."""
    chunk_guard: bool = True
    """Cut or park a continuing chunk the free KV cannot hold (SGLang 0.5.23 hands it a whole chunk once the pass budget is spent, and the failed allocation ends the server)."""
    chunk_guard_decode_steps: int = 8
    """Decode steps of KV the chunk guard keeps free for the running requests (rows x steps) when it hands a continuing chunk the last free KV; 0: none."""
    kv_high_watermark: float = 0.95
    """KV usage at which admission of new requests stops (1.0: only when full)."""
    kv_low_watermark: float = 0.85
    """KV usage below which admission resumes."""
    loop_min_tokens: int = 0
    """Cut outputs whose tail repeats a short period for this many tokens; 0: off."""
    loop_max_period: int = 8
    """Longest repeating period (tokens) the loop detector looks for."""
    loop_action: str = "finish"
    """finish: end the request with a 'repetition_loop' finish reason; retract: free its KV and requeue it."""
    loop_max_retracts: int = 1
    """With loop_action=retract: loop retractions of one request before its next loop finishes it."""
    max_partial_prefills: int = 1
    """Requests partially prefilled at once: above 1, an earlier-key request larger than a pass suspends the partial one (KV kept) and starts its own."""
    max_long_partial_prefills: int = 1
    """Of those, at most this many with more than long_partial_tokens of work."""
    long_partial_tokens: int = 0
    """Work (tokens) above which a partial prefill counts as long; 0: 16 budgets."""
    publish_interval_s: float = 0.5
    """Seconds between snapshots for /kllm/stats."""

    def __post_init__(self) -> None:
        for name in ("budget_tokens", "base_quota_tokens", "max_quota_tokens", "decode_every_chunks", "loop_min_tokens",
                     "busy_decode_reqs", "chunk_guard_decode_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.short_extra_tokens < -1:
            raise ValueError(f"short_extra_tokens must be >= -1 (-1: one budget), got {self.short_extra_tokens}")
        if not 0.0 <= self.age_weight <= 1e6:
            raise ValueError(f"age_weight must be in [0, 1e6], got {self.age_weight}")
        if not 0.0 <= self.decode_interval_s <= 60.0:
            raise ValueError(f"decode_interval_s must be in [0, 60], got {self.decode_interval_s}")
        if not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {self.decode_share}")
        if not 0.0 <= self.decode_time_share < 1.0:
            raise ValueError(f"decode_time_share must be in [0, 1), got {self.decode_time_share}")
        if not 0.0 <= self.decode_max_gap_s <= 60.0:
            raise ValueError(f"decode_max_gap_s must be in [0, 60], got {self.decode_max_gap_s}")
        if self.budget_tokens == 1:
            raise ValueError("budget_tokens must be 0 (use SGLang's chunk size) or >= 2, got 1")
        if not self.quota_growth >= 1.0:
            raise ValueError(f"quota_growth must be >= 1.0, got {self.quota_growth}")
        if self.max_quota_tokens and self.base_quota_tokens and self.max_quota_tokens < self.base_quota_tokens:
            raise ValueError(
                f"max_quota_tokens must be >= base_quota_tokens ({self.base_quota_tokens}), got {self.max_quota_tokens}"
            )
        if self.max_yields < 0:
            raise ValueError(f"max_yields must be >= 0, got {self.max_yields}")
        if not 0.0 < self.long_min_share <= 1.0:
            raise ValueError(f"long_min_share must be in (0, 1], got {self.long_min_share}")
        if not 0.0 < self.kv_high_watermark <= 1.0:
            raise ValueError(f"kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")
        if not 0.0 <= self.kv_low_watermark < self.kv_high_watermark:
            raise ValueError(
                f"kv_low_watermark must be in [0, kv_high_watermark={self.kv_high_watermark}), got {self.kv_low_watermark}"
            )
        if self.loop_min_tokens == 1:
            raise ValueError("loop_min_tokens must be 0 (off) or >= 2, got 1")
        if self.loop_max_period < 1:
            raise ValueError(f"loop_max_period must be >= 1, got {self.loop_max_period}")
        if self.loop_min_tokens and self.loop_max_period > self.loop_min_tokens // 2:
            raise ValueError(
                f"loop_max_period must be <= loop_min_tokens // 2 = {self.loop_min_tokens // 2}, got {self.loop_max_period}"
            )
        if self.loop_max_retracts < 0:
            raise ValueError(f"loop_max_retracts must be >= 0, got {self.loop_max_retracts}")
        if self.loop_action not in LOOP_ACTIONS:
            raise ValueError(f"loop_action must be one of {LOOP_ACTIONS}, got {self.loop_action!r}")
        if self.max_partial_prefills < 1:
            raise ValueError(f"max_partial_prefills must be >= 1, got {self.max_partial_prefills}")
        if not 1 <= self.max_long_partial_prefills <= self.max_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be in [1, max_partial_prefills="
                             f"{self.max_partial_prefills}], got {self.max_long_partial_prefills}")
        if self.long_partial_tokens < 0:
            raise ValueError(f"long_partial_tokens must be >= 0, got {self.long_partial_tokens}")
        if not 0 < self.publish_interval_s <= 60:
            raise ValueError(f"publish_interval_s must be in (0, 60], got {self.publish_interval_s}")

    def quota_params(self, chunk_tokens: int, page_size: int = 1) -> QuotaParams:
        """The policy parameters for a scheduler whose chunked-prefill size is `chunk_tokens`."""
        budget = self.budget_tokens or chunk_tokens
        base = self.base_quota_tokens or budget
        return QuotaParams(
            budget_tokens=budget,
            base_quota_tokens=base,
            quota_growth=self.quota_growth,
            max_quota_tokens=max(self.max_quota_tokens or 4 * budget, base),
            max_yields=self.max_yields,
            long_min_share=self.long_min_share,
            decode_every_chunks=self.decode_every_chunks,
            page_size=page_size,
            short_extra_tokens=3 * budget if self.short_extra_tokens < 0 else self.short_extra_tokens,
            age_weight=self.age_weight,
            decode_interval_s=self.decode_interval_s,
            busy_decode_reqs=self.busy_decode_reqs,
            decode_max_gap_s=self.decode_max_gap_s,
            decode_share=self.decode_share,
            decode_time_share=self.decode_time_share,
            max_partial=self.max_partial_prefills,
            max_long_partial=self.max_long_partial_prefills,
            long_partial_tokens=self.long_partial_tokens,
        )
