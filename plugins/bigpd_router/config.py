"""Layer: plugin config (no SGLang import). Options of the bigpd_router service."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("slo_affinity", "round_robin", "least_load")


@dataclass(frozen=True)
class RouterConfig:
    ttft_target_s: float = 1.0
    """TTFT SLO target (seconds); Load_P = max(TTFT_pred, TTFT_actual) / ttft_target_s."""
    tpot_target_s: float = 0.1
    """TPOT SLO target (seconds per output token); Load_D likewise with TPOT."""
    policy: str = "slo_affinity"
    """Instance choice: slo_affinity (prefix affinity balanced against SLO Load), round_robin, least_load."""
    affinity_weight: float = 1.0
    """How many units of Load one fully matched prefix is worth when picking a prefill instance."""
    affinity_block_chars: int = 64
    """Granularity (characters of the prompt) of the router's approximate prefix tree."""
    affinity_max_blocks: int = 200_000
    """Blocks kept in the approximate prefix tree before least-recently-used leaves are evicted."""
    kv_events: bool = True
    """Subscribe to the KV events of instances that publish them and route prefills on them."""
    tokenizer_path: str = ""
    """Tokenizer for KV-event lookups of text prompts (empty: the path the instances report, if present here)."""
    request_timeout_s: float = 300.0
    """Whole-request timeout toward an instance."""
    first_token_timeout_s: float = 60.0
    """Time allowed until the first byte of a streamed answer before the request is retried elsewhere
    (a non-streamed answer has no visible first token: its whole answer gets request_timeout_s)."""
    max_retries: int = 1
    """Retries on another instance when one fails before the first token. A request whose instance
    died under it (the connection dropped with no answer) is retried at most once whatever this says,
    and never after a second such crash: it is refused for poison_quarantine_s instead."""
    stall_timeout_s: float = 30.0
    """Longest silence between two pieces of a started stream before it is ended with an error event
    (the request is aborted on its instance)."""
    poison_quarantine_s: float = 600.0
    """How long an identical request that crashed two instances is refused (HTTP 422) without being sent."""
    validate_inputs: bool = True
    """Refuse token ids outside the model's vocabulary and prompts longer than its context (HTTP 400),
    where the instances tell the router both (vocabulary: the model's config.json next to the router)."""
    liveness_interval_s: float = 0.5
    """Seconds between liveness probes of each routable instance (GET /model_info, answered by the
    HTTP process without the scheduler); 0 disables them (only the health checks remain)."""
    liveness_timeout_s: float = 1.5
    """A liveness probe unanswered this long counts as a miss; liveness_failures misses in a row mark
    the instance down and fail over requests on it that have no token yet."""
    liveness_failures: int = 2
    """Consecutive missed liveness probes before an instance is marked down."""
    header_timeout_s: float = 10.0
    """Time a client has to send a request head (HTTP 408 and close after it)."""
    body_timeout_s: float = 30.0
    """Time a client has to send a request body once its head arrived (HTTP 408 and close after it)."""
    idle_timeout_s: float = 30.0
    """An idle keep-alive client connection is closed after this many seconds."""
    max_client_connections: int = 2048
    """Open connections allowed from one client address (more are answered 503 and closed; 0: no cap)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest accepted request body; larger ones get HTTP 413."""
    health_interval_s: float = 2.0
    """Seconds between active health checks of each instance."""
    health_failures: int = 2
    """Consecutive failed checks (or failed requests) before an instance is marked unhealthy."""
    loads_interval_s: float = 1.0
    """Seconds between polls of each instance's /v1/loads (0 disables polling)."""
    load_window_s: float = 30.0
    """Window (seconds) over which measured TTFT/TPOT make up the 'actual' half of SLO Load."""
    scale_interval_s: float = 5.0
    """Seconds between scaling-controller decisions (0 disables the controller)."""
    scale_up_load: float = 0.9
    """Scale a pool up when its SLO Load stays above this for scale_up_sustain_s."""
    scale_urgent_load: float = 0.0
    """Predicted Load (backlog over measured rates) above which a pool scales up without waiting for
    scale_up_sustain_s (0: off)."""
    scale_role_switch: bool = False
    """Meet a PD pool's shortage by flipping an idle instance of the other pool (SGLang's
    /pd_role_switch; instances need --enable-pd-role-switch) before starting a new one."""
    scale_down_load: float = 0.4
    """Scale a pool down when its SLO Load (as it would be with one instance fewer) stays below this."""
    scale_up_sustain_s: float = 10.0
    """How long Load must stay above scale_up_load before adding an instance."""
    scale_down_sustain_s: float = 60.0
    """How long Load must stay below scale_down_load before removing an instance."""
    scale_cooldown_s: float = 30.0
    """Minimum time between two scaling actions on the same pool."""
    min_instances: int = 1
    """Never scale a pool below this many instances."""
    max_instances: int = 4
    """Never scale a pool above this many instances."""
    drain_timeout_s: float = 120.0
    """Longest wait for in-flight requests on an instance being removed."""
    min_prefill_instances: int = -1
    """Minimum of the prefill pool (-1: min_instances)."""
    min_decode_instances: int = -1
    """Minimum of the decode pool (-1: min_instances)."""
    scale_trend_lookahead_s: float = 0.0
    """Extrapolate each pool's predicted Load this many seconds along its recent slope; the
    projection counts as high Load (about an instance's start-up time; 0: off)."""
    scale_trend_window_s: float = 30.0
    """Seconds of predicted-Load samples the slope is fitted on."""
    scale_down_after_up_s: float = 0.0
    """No scale-down of a pool within this many seconds after its last scale-up."""

    def pool_minimum(self, role: str) -> int:
        """The minimum of one pool ("prefill", "decode" or "plain")."""
        own = {"prefill": self.min_prefill_instances, "decode": self.min_decode_instances}.get(role, -1)
        return self.min_instances if own < 0 else own

    def __post_init__(self) -> None:
        for name in ("ttft_target_s", "tpot_target_s", "request_timeout_s", "first_token_timeout_s",
                     "health_interval_s", "load_window_s", "stall_timeout_s", "liveness_timeout_s",
                     "header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("loads_interval_s", "scale_interval_s", "scale_up_sustain_s", "scale_down_sustain_s",
                     "scale_cooldown_s", "drain_timeout_s", "affinity_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.affinity_block_chars < 1:
            raise ValueError(f"affinity_block_chars must be >= 1, got {self.affinity_block_chars}")
        if self.affinity_max_blocks < 1:
            raise ValueError(f"affinity_max_blocks must be >= 1, got {self.affinity_max_blocks}")
        for name in ("poison_quarantine_s", "liveness_interval_s", "max_client_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.liveness_failures < 1:
            raise ValueError(f"liveness_failures must be >= 1, got {self.liveness_failures}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.health_failures < 1:
            raise ValueError(f"health_failures must be >= 1, got {self.health_failures}")
        if self.scale_urgent_load and self.scale_urgent_load <= self.scale_up_load:
            raise ValueError(f"scale_urgent_load must be 0 or > scale_up_load, got {self.scale_urgent_load}")
        if not 0 <= self.scale_down_load < self.scale_up_load:
            raise ValueError(
                f"scale_down_load must be in [0, scale_up_load), got {self.scale_down_load} "
                f"(scale_up_load={self.scale_up_load})"
            )
        for name in ("scale_trend_lookahead_s", "scale_down_after_up_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.scale_trend_window_s > 0:
            raise ValueError(f"scale_trend_window_s must be > 0, got {self.scale_trend_window_s}")
        for name in ("min_prefill_instances", "min_decode_instances"):
            if not -1 <= getattr(self, name) <= self.max_instances:
                raise ValueError(f"{name} must be -1 or in [0, max_instances], got {getattr(self, name)}")
        if self.min_instances < 0:
            raise ValueError(f"min_instances must be >= 0, got {self.min_instances}")
        if self.max_instances < max(1, self.min_instances):
            raise ValueError(
                f"max_instances must be >= max(1, min_instances), got {self.max_instances}"
            )
