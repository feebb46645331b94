"""Layer: plugin config (no SGLang import). Options of the dspark planner plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.plugins.dspark.core.budget import OBJECTIVES, PlannerConfig
from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig

RAGGED_MODES: tuple[str, ...] = ("compact", "cap-accept", "static")


def parse_knots(text: str) -> tuple[int, ...]:
    """Option type: "64,256,1024" -> (64, 256, 1024)."""
    if isinstance(text, (tuple, list)):
        return tuple(int(p) for p in text)
    parts = [p.strip() for p in str(text).strip("[]() ").split(",") if p.strip()]
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class DsparkConfig:
    objective: str = "throughput"
    """"throughput": maximise accepted tokens/s; "sla": first keep requests at sla_tokens_per_s."""
    sla_tokens_per_s: float = 0.0
    """Per-request speed floor (tokens/s per user) for objective="sla"."""
    sla_softness: float = 0.1
    """Width of the smooth SLA indicator as a fraction of the SLA (0: hard threshold)."""
    min_verify_len: int = 1
    """Fewest tokens a request verifies per step (the anchor counts)."""
    max_verify_len: int = 0
    """Most tokens a request verifies per step; 0 means gamma + 1."""
    survival_eps: float = 1e-6
    ragged_mode: str = "compact"
    """SGLANG_RAGGED_VERIFY_MODE set when the user has not set it ("static" keeps SGLang's default)."""
    half_life_steps: float = 64.0
    window: int = 256
    knots: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    explore_prob: float = 0.02
    warmup_explore_prob: float = 0.5
    refit_every: int = 4
    max_step_gap_s: float = 1.0
    """Intervals between planning calls longer than this are not step times (idle, preemption)."""
    publish_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.ragged_mode not in RAGGED_MODES:
            raise ValueError(f"ragged_mode must be one of {RAGGED_MODES}, got {self.ragged_mode!r}")
        if self.max_step_gap_s <= 0:
            raise ValueError(f"max_step_gap_s must be > 0, got {self.max_step_gap_s}")
        if not 0 < self.publish_interval_s <= 60:
            raise ValueError(f"publish_interval_s must be in (0, 60], got {self.publish_interval_s}")
        # The core configs validate the rest and name the field.
        self.planner_config()
        self.cost_model_config()

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(
            min_verify_len=self.min_verify_len,
            max_verify_len=self.max_verify_len,
            survival_eps=self.survival_eps,
            objective=self.objective,  # type: ignore[arg-type]
            sla_tokens_per_s=self.sla_tokens_per_s,
            sla_softness=self.sla_softness,
            explore_prob=self.explore_prob,
            warmup_explore_prob=self.warmup_explore_prob,
        )

    def cost_model_config(self) -> CostModelConfig:
        return CostModelConfig(
            half_life_steps=self.half_life_steps,
            window=self.window,
            knots=tuple(self.knots),
            refit_every=self.refit_every,
        )
