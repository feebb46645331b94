"""Layer: plugin core (no SGLang import). The trace plugin's counters.

A batch is described by plain values (kind, requests, new tokens), so the counting rules are
tested without a scheduler.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerCounters:
    passes: int = 0
    """Calls to the scheduler's batch selection (idle passes included)."""
    prefill_batches: int = 0
    prefill_chunks: int = 0
    """One per request per extend batch: a prompt prefilled in k chunks adds k."""
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    idle_passes: int = 0
    select_seconds: float = 0.0
    """Wall time inside batch selection (`get_next_batch_to_run`), all passes."""
    prefill_select_seconds: float = 0.0
    """Wall time of the passes that chose a prefill batch: between two chunks of a long prompt
    this is the scheduler's gap (stashing the previous chunk into the tree included)."""
    select_seconds_max: float = 0.0

    def observe(self, kind: str | None, num_reqs: int = 0, new_tokens: int = 0, seconds: float = 0.0) -> None:
        self.passes += 1
        self.select_seconds += seconds
        if seconds > self.select_seconds_max:
            self.select_seconds_max = seconds
        if kind == "prefill":
            self.prefill_select_seconds += seconds
        if kind is None:
            self.idle_passes += 1
        elif kind == "prefill":
            self.prefill_batches += 1
            self.prefill_chunks += num_reqs
            self.prefill_tokens += new_tokens
        elif kind == "decode":
            self.decode_steps += 1
            self.decode_tokens += num_reqs
        else:
            raise ValueError(f"unknown batch kind {kind!r}")

    def snapshot(self) -> dict[str, float]:
        return asdict(self)
