"""Layer: plugin config (no SGLang import). Options of the trace plugin."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceConfig:
    log_interval_s: float = 10.0
    """Seconds between INFO summary lines from the scheduler (0 disables them)."""
    publish_interval_s: float = 0.2
    """Seconds between snapshots written for the /kllm/stats endpoint."""
    profile_path: str = ""
    """If set, cProfile every batch selection (`get_next_batch_to_run` and what it calls) and
    write the pstats to this path (with the scheduler's pid appended) every 2 s while busy."""

    def __post_init__(self) -> None:
        if self.log_interval_s < 0:
            raise ValueError(f"log_interval_s must be >= 0, got {self.log_interval_s}")
        if not 0 < self.publish_interval_s <= 60:
            raise ValueError(f"publish_interval_s must be in (0, 60], got {self.publish_interval_s}")
