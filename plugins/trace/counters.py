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

    def observe(self, kind: str | None, num_reqs: int = 0, new_tokens: int = 0) -> None:
        self.passes += 1
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

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
