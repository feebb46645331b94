"""Layer: SGLang adapter of input_guard. Runs in the process of SGLang's TokenizerManager."""
from __future__ import annotations

import logging
from typing import Any

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.input_guard.core import GuardStats, input_ids_problem

log = logging.getLogger("kllm.input_guard")


class _Guard:
    def __init__(self) -> None:
        cfg = runtime.config_of("input_guard")
        self.check_ids = cfg.check_token_ids
        self.max_len = cfg.max_input_ids
        self.stats = GuardStats()
        self.m_refused = metrics.counter("kllm_input_guard_refused_total",
                                         "requests refused for input_ids the model cannot take")


_guard: _Guard | None = None


def before_validate_one_request(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """Raise ValueError (SGLang answers 400) for ids outside the vocabulary; otherwise change nothing."""
    global _guard
    if _guard is None:
        _guard = _Guard()
    g = _guard
    if not g.check_ids or not input_ids:
        return None
    g.stats.checked += 1
    problem = input_ids_problem(input_ids, int(self.model_config.vocab_size), g.max_len)
    if problem is not None:
        g.stats.refused += 1
        g.m_refused.inc()
        log.warning("refused request rid=%s: %s", getattr(obj, "rid", None), problem)
        raise ValueError(problem)
    return None
