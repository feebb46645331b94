"""Layer: core (no SGLang import). What the model accepts, checked before a request is sent.

SGLang 0.5.23 checks a prompt's length against the context but not its token ids against the
vocabulary: an id past the embedding table crashes the scheduler and takes the instance down.
The router learns the vocabulary size and the context length from the instances (and the
model's config.json) and refuses such prompts with a clear 400 instead.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int | None = None
    context_len: int | None = None

    @property
    def known(self) -> bool:
        return self.vocab_size is not None or self.context_len is not None


def token_id_problem(ids: Sequence[int], vocab_size: int | None, context_len: int | None) -> str | None:
    """A one-line reason the ids cannot be served, or None when they can (or nothing is known)."""
    if not ids:
        return None
    if context_len is not None and len(ids) >= context_len:
        return f"the prompt has {len(ids)} tokens; the model's context is {context_len} tokens"
    if vocab_size is not None:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            return f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
    return None


def vocab_from_config(path: str | None) -> int | None:
    """vocab_size of a local Hugging Face model folder (config.json, or its text_config)."""
    if not path or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            cfg: Any = json.load(fh)
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        v = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None
