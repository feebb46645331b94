"""Layer: plugin config (no SGLang import). Options of the dspark planner plugin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kllm_plugins.plugins.dspark.core.budget import OBJECTIVES, Objective, PlannerConfig
from kllm_plugins.plugins.dspark.core.cost_model import CostModelConfig
from kllm_plugins.spec import check_config, option

RaggedMode = Literal["compact", "cap-accept", "static"]
RAGGED_MODES: tuple[str, ...] = get_args(RaggedMode)


def parse_knots(text: str) -> tuple[int, ...]:
    """Option type: "64,256,1024" -> (64, 256, 1024)."""
    if isinstance(text, (tuple, list)):
        return tuple(int(p) for p in text)
    parts = [p.strip() for p in str(text).strip("[]() ").split(",") if p.strip()]
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class DsparkConfig:
    objective: Objective = option("throughput", "throughput, or sla (per-user tokens/s floor first)")
    """"throughput": maximise accepted tokens/s; "sla": first keep requests at sla_tokens_per_s."""
    sla_tokens_per_s: float = option(0.0, "per-request speed floor for objective=sla")
    """Per-request speed floor (tokens/s per user) for objective="sla"."""
    sla_softness: float = option(0.1, "width of the smooth SLA indicator, fraction of the SLA (0: hard)")
    """Width of the smooth SLA indicator as a fraction of the SLA (0: hard threshold)."""
    min_verify_len: int = option(1, "fewest tokens each request verifies per step (anchor included)")
    """Fewest tokens a request verifies per step (the anchor counts)."""
    max_verify_len: int = option(0, "most tokens each request verifies per step (0: gamma+1)")
    """Most tokens a request verifies per step; 0 means gamma + 1."""
    survival_eps: float = option(1e-6, "survival probabilities below this are never verified")
    ragged_mode: RaggedMode = option(
        "compact", 'SGLANG_RAGGED_VERIFY_MODE used when the user has not set it')
    """SGLANG_RAGGED_VERIFY_MODE set when the user has not set it ("static" keeps SGLang's default)."""
    half_life_steps: float = option(64.0, "age in steps at which a step-time observation weighs half")
    window: int = option(256, "step-time observations kept for the cost fit")
    knots: tuple[int, ...] = option(
        (32, 64, 128, 256, 512, 1024), 'verify-token counts where the cost slope may change', parse=parse_knots)
    explore_prob: float = option(0.02, "probability of a random budget once the model is trusted")
    warmup_explore_prob: float = option(0.5, "probability of a random budget while learning")
    refit_every: int = option(4, "refit the cost model every N observed steps")
    max_step_gap_s: float = option(1.0, "longer gaps between decode steps are not timed", gt=0)
    """Intervals between planning calls longer than this are not step times (idle, preemption)."""
    publish_interval_s: float = option(1.0, "seconds between /kllm/stats snapshots", gt=0, le=60)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.ragged_mode not in RAGGED_MODES:
            raise ValueError(f"ragged_mode must be one of {RAGGED_MODES}, got {self.ragged_mode!r}")
        check_config(self)
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
