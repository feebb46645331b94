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
