"""Layer: plugin core (no SGLang import). Fair chunked-prefill policy, KV watermark and loop detector."""
from __future__ import annotations

from kllm_plugins.plugins.fair_sched.core.quota import (
    FairPolicy,
    LongState,
    PassPlan,
    QuotaParams,
    WaitingItem,
    max_stretch_bound,
    pass_bound,
    solo_passes,
    stretch_bound,
    yield_bound,
)
from kllm_plugins.plugins.fair_sched.core.repetition import RepetitionDetector, find_loop
from kllm_plugins.plugins.fair_sched.core.watermark import WatermarkGate

__all__ = [
    "FairPolicy",
    "LongState",
    "PassPlan",
    "QuotaParams",
    "RepetitionDetector",
    "WaitingItem",
    "WatermarkGate",
    "find_loop",
    "max_stretch_bound",
    "pass_bound",
    "solo_passes",
    "stretch_bound",
    "yield_bound",
]
