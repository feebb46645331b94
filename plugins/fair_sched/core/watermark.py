"""Layer: plugin core (no SGLang import). Decode KV protection: a high/low watermark admission gate.

Above the high watermark of KV usage the gate closes (no new request is admitted); it opens
again only once usage falls below the low watermark. The gap between the two (hysteresis)
keeps admission from flapping on every pass around one threshold.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatermarkGate:
    high: float
    low: float
    paused: bool = False
    usage: float = 0.0
    pauses: int = 0
    """Times the gate closed."""
    resumes: int = 0
    blocked_passes: int = 0
    """Passes in which admission was refused."""

    def __post_init__(self) -> None:
        if not 0.0 < self.high <= 1.0:
            raise ValueError(f"kv_high_watermark must be in (0, 1], got {self.high}")
        if not 0.0 <= self.low < self.high:
            raise ValueError(f"kv_low_watermark must be in [0, kv_high_watermark={self.high}), got {self.low}")

    def update(self, used_tokens: int, total_tokens: int) -> bool:
        """Record the KV usage; return True while admission is allowed."""
        if total_tokens <= 0:
            raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
        self.usage = min(max(used_tokens / total_tokens, 0.0), 1.0)
        if not self.paused and self.usage >= self.high:
            self.paused = True
            self.pauses += 1
        elif self.paused and self.usage < self.low:
            self.paused = False
            self.resumes += 1
        if self.paused:
            self.blocked_passes += 1
        return not self.paused

    def state(self) -> dict[str, float | int | bool]:
        """What a router reads: usage, thresholds and whether admission is paused."""
        return {
            "kv_usage": round(self.usage, 4),
            "kv_high_watermark": self.high,
            "kv_low_watermark": self.low,
            "admission_paused": self.paused,
            "watermark_pauses": self.pauses,
            "watermark_resumes": self.resumes,
            "watermark_blocked_passes": self.blocked_passes,
        }


def continuation_tokens(chunk_limit: int, budget_left: float, free_tokens: int, page_size: int = 1,
                        slack_pages: int = 2, decode_reserve: int = 0) -> int | None:
    """Tokens the continuing chunk of a partially prefilled request may allocate this pass.

    SGLang 0.5.23's single-pool prefill budget hands the continuation a whole chunk once the pass
    budget is spent (`budget_left <= 0`, the budget counts the decode headroom it reserves for
    running requests) so that the request makes progress; when the pool's free and evictable tokens
    are fewer than that chunk, the allocation fails and the scheduler, with the whole server, exits.
    Here a spent budget gives the whole chunk only when it fits in `free_tokens` with
    `slack_pages` of slack plus `decode_reserve` tokens (rounded up to pages) left for the
    running requests' next decode steps, else the largest page multiple that does, else None:
    the chunk sits out this pass while the running requests decode and finish. Without the
    reserve the chunk takes the last free pages and the next decode step finds none: SGLang then
    retracts a decoding request (its KV recomputed later) and resets its reservation ratio to 1.0,
    which throttles admission for hundreds of steps.
    With budget left, SGLang's own answer stands (`min(chunk_limit, budget_left)`).
    """
    if chunk_limit <= 0 or page_size <= 0 or decode_reserve < 0:
        raise ValueError(f"chunk_limit and page_size must be > 0 and decode_reserve >= 0, got {chunk_limit}, "
                         f"{page_size}, {decode_reserve}")
    if budget_left > 0:
        return int(min(chunk_limit, budget_left))
    reserve_pages = slack_pages + -(-decode_reserve // page_size)
    room = (free_tokens - reserve_pages * page_size) // page_size * page_size
    if room >= chunk_limit:
        return chunk_limit
    return room if room >= page_size else None
