"""Layer: plugin config (no SGLang import). Options of the input_guard plugin."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputGuardConfig:
    check_token_ids: bool = True
    """Refuse a request whose input_ids hold an id outside [0, vocab_size) (HTTP 400)."""
    max_input_ids: int = 0
    """Refuse input_ids lists longer than this before any other check (0: no limit of its own;
    SGLang's context-length check still applies)."""

    def __post_init__(self) -> None:
        if self.max_input_ids < 0:
            raise ValueError(f"max_input_ids must be >= 0, got {self.max_input_ids}")
