"""Layer: plugin core (no SGLang import). Detects runaway outputs: a repetition loop.

A loop is the output's tail repeating one period of at most `max_period` tokens for at least
`min_loop_tokens` tokens (e.g. "ab ab ab ..." or one token over and over). Checking the tail
after every new token costs O(max_period) per token with a per-period run counter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def find_loop(tokens: Sequence[int], min_loop_tokens: int, max_period: int) -> tuple[int, int] | None:
    """(period, run) of the shortest period whose periodic tail is at least `min_loop_tokens`
    long, or None. `run` counts the tail tokens equal to the token one period earlier plus
    one period, i.e. the length of the periodic tail. Reference implementation (O(n*p))."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        if 2 * p > n:
            break
        run = p
        i = n - 1
        while i - p >= 0 and tokens[i] == tokens[i - p]:
            run += 1
            i -= 1
        if run >= min_loop_tokens and run >= 2 * p:
            return p, run
    return None


@dataclass
class RepetitionDetector:
    """Incremental form of `find_loop` for one request's output."""

    min_loop_tokens: int
    max_period: int
    tokens: list[int] = field(default_factory=list)
    _runs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.min_loop_tokens < 2:
            raise ValueError(f"loop_min_tokens must be >= 2, got {self.min_loop_tokens}")
        if not 1 <= self.max_period <= self.min_loop_tokens // 2:
            raise ValueError(
                f"loop_max_period must be in [1, loop_min_tokens // 2 = {self.min_loop_tokens // 2}], got {self.max_period}"
            )
        # _runs[p-1]: count of trailing positions i with tokens[i] == tokens[i-p].
        self._runs = [0] * self.max_period

    def push(self, token: int) -> tuple[int, int] | None:
        """Append one output token; return (period, loop length) once a loop is long enough."""
        self.tokens.append(int(token))
        n = len(self.tokens)
        found: tuple[int, int] | None = None
        for p in range(1, self.max_period + 1):
            if n - 1 - p >= 0 and self.tokens[n - 1] == self.tokens[n - 1 - p]:
                self._runs[p - 1] += 1
            else:
                self._runs[p - 1] = 0
            run = self._runs[p - 1] + p
            if found is None and self._runs[p - 1] >= p and run >= self.min_loop_tokens:
                found = (p, run)
        # Only the last max_period tokens are ever compared again.
        if n > 4 * self.max_period + 64:
            del self.tokens[: n - self.max_period]
        return found

    def restart(self) -> None:
        """Forget the output seen so far: the next loop is judged on new tokens only (used after a
        loop retraction, whose kept output still ends in the old loop)."""
        self.tokens.clear()
        self._runs = [0] * self.max_period

    def extend(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        found = None
        for t in tokens:
            found = self.push(t) or found
        return found
