"""Layer: plugin config (no SGLang import). Options of the input_guard plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.spec import check_config, option


@dataclass(frozen=True)
class InputGuardConfig:
    check_token_ids: bool = option(True, "refuse input_ids outside [0, vocab_size) (HTTP 400)")
    """Refuse a request whose input_ids hold an id outside [0, vocab_size) (HTTP 400)."""
    max_input_ids: int = option(0, "refuse input_ids lists longer than this (0: no own limit)", ge=0)
    """Refuse input_ids lists longer than this before any other check (0: no limit of its own;
    SGLang's context-length check still applies)."""

    def __post_init__(self) -> None:
        check_config(self)
