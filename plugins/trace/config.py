"""Layer: plugin config (no SGLang import). Options of the trace plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.spec import check_config, option


@dataclass(frozen=True)
class TraceConfig:
    log_interval_s: float = option(10.0, "seconds between scheduler summary log lines (0: off)", ge=0)
    """Seconds between INFO summary lines from the scheduler (0 disables them)."""
    publish_interval_s: float = option(0.2, "seconds between snapshots for /kllm/stats", gt=0, le=60)
    """Seconds between snapshots written for the /kllm/stats endpoint."""
    profile_path: str = option("", "cProfile batch selection and write pstats here (debug; costs time)")
    """If set, cProfile every batch selection (`get_next_batch_to_run` and what it calls) and
    write the pstats to this path (with the scheduler's pid appended) every 2 s while busy."""

    def __post_init__(self) -> None:
        check_config(self)
