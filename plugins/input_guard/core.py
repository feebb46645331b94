"""Layer: core (no SGLang import). The checks input_guard runs on one request's token ids.

SGLang 0.5.23 checks a prompt's length against the context length but not the ids themselves:
an id at or past the embedding table's size reaches the model and the scheduler process dies
(the whole server goes down with it). These checks are cheap (one min and one max over the ids)
and name what is wrong in one line, which SGLang returns to the client as an HTTP 400.
"""
from __future__ import annotations

from typing import Sequence


class GuardStats:
    """Counts of what the guard looked at and refused (exported by the adapter)."""

    __slots__ = ("checked", "refused")

    def __init__(self) -> None:
        self.checked = 0
        self.refused = 0


def input_ids_problem(ids: Sequence[int] | None, vocab_size: int, max_len: int = 0) -> str | None:
    """A one-line reason the ids cannot be served, or None."""
    if not ids:
        return None
    if max_len and len(ids) > max_len:
        return f"input_ids has {len(ids)} tokens; this server accepts at most {max_len}"
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return (f"input_ids holds token id {bad}, outside the model's vocabulary [0, {vocab_size}) "
                f"(refused by kllm input_guard)")
    return None
