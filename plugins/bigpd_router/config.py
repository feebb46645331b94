"""Layer: plugin config (no SGLang import). Options of the bigpd_router service.

Each field declares its option (`option()`: one-line help, range bounds); the plugin's
`OptionSpec`s are derived from this dataclass (`options_from_config`), so the `kllm-router` flags,
`KLLM_BIGPD_ROUTER_*` variables, YAML keys and the docs' options table come from here.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from kllm_plugins.spec import check_config, option

Policy = Literal["slo_affinity", "round_robin", "least_load"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)


@dataclass(frozen=True)
class RouterConfig:
    ttft_target_s: float = option(1.0, "TTFT SLO target in seconds (Load_P denominator)", gt=0)
    """TTFT SLO target (seconds); Load_P = max(TTFT_pred, TTFT_actual) / ttft_target_s."""
    tpot_target_s: float = option(0.1, "TPOT SLO target in seconds per token (Load_D denominator)", gt=0)
    """TPOT SLO target (seconds per output token); Load_D likewise with TPOT."""
    policy: Policy = option("slo_affinity", "instance choice: slo_affinity, round_robin or least_load")
    """Instance choice: slo_affinity (prefix affinity balanced against SLO Load), round_robin, least_load."""
    affinity_weight: float = option(
        1.0, "trust in the approximate prefix tree (1: a matched prefix counts as cached)", ge=0)
    """How many units of Load one fully matched prefix is worth when picking a prefill instance."""
    affinity_block_chars: int = option(64, "prompt characters per block of the approximate prefix tree", ge=1)
    """Granularity (characters of the prompt) of the router's approximate prefix tree."""
    affinity_max_blocks: int = option(200_000, "blocks kept in the approximate prefix tree (LRU)", ge=1)
    """Blocks kept in the approximate prefix tree before least-recently-used leaves are evicted."""
    kv_events: bool = option(True, "subscribe to instances' KV events (--kv-events-config) and route prefills on them")
    """Subscribe to the KV events of instances that publish them and route prefills on them."""
    tokenizer_path: str = option(
        "", "tokenizer for KV-event lookups of text prompts (default: the instances' own, if present)")
    """Tokenizer for KV-event lookups of text prompts (empty: the path the instances report, if present here)."""
    request_timeout_s: float = option(300.0, "whole-request timeout toward an instance", gt=0)
    """Whole-request timeout toward an instance."""
    first_token_timeout_s: float = option(60.0, "time to the first byte before retrying elsewhere", gt=0)
    """Time allowed until the first byte of a streamed answer before the request is retried elsewhere
    (a non-streamed answer has no visible first token: its whole answer gets request_timeout_s)."""
    max_retries: int = option(1, "retries on another instance when one fails before the first token", ge=0)
    """Retries on another instance when one fails before the first token. A request whose instance
    died under it (the connection dropped with no answer) is retried at most once whatever this says,
    and never after a second such crash: it is refused for poison_quarantine_s instead."""
    stall_timeout_s: float = option(
        30.0, "longest silence between two pieces of a started stream before it ends with an error", gt=0)
    """Longest silence between two pieces of a started stream before it is ended with an error event
    (the request is aborted on its instance)."""
    poison_quarantine_s: float = option(
        600.0, "seconds an identical request that crashed two instances is refused (HTTP 422)", ge=0)
    """How long an identical request that crashed two instances is refused (HTTP 422) without being sent."""
    validate_inputs: bool = option(
        True, "refuse token ids outside the vocabulary and prompts over the context (HTTP 400)")
    """Refuse token ids outside the model's vocabulary and prompts longer than its context (HTTP 400),
    where the instances tell the router both (vocabulary: the model's config.json next to the router)."""
    liveness_interval_s: float = option(0.5, "seconds between liveness probes of each instance (0: off)", ge=0)
    """Seconds between liveness probes of each routable instance (GET /model_info, answered by the
    HTTP process without the scheduler); 0 disables them (only the health checks remain)."""
    liveness_timeout_s: float = option(1.5, "a liveness probe unanswered this long is a miss", gt=0)
    """A liveness probe unanswered this long counts as a miss; liveness_failures misses in a row mark
    the instance down and fail over requests on it that have no token yet."""
    liveness_failures: int = option(2, "missed liveness probes in a row before an instance is marked down", ge=1)
    """Consecutive missed liveness probes before an instance is marked down."""
    header_timeout_s: float = option(10.0, "seconds a client has to send a request head (HTTP 408)", gt=0)
    """Time a client has to send a request head (HTTP 408 and close after it)."""
    body_timeout_s: float = option(30.0, "seconds a client has to send a request body (HTTP 408)", gt=0)
    """Time a client has to send a request body once its head arrived (HTTP 408 and close after it)."""
    idle_timeout_s: float = option(30.0, "seconds before an idle keep-alive client connection is closed", gt=0)
    """An idle keep-alive client connection is closed after this many seconds."""
    max_client_connections: int = option(2048, "open connections allowed per client address (0: no cap)", ge=0)
    """Open connections allowed from one client address (more are answered 503 and closed; 0: no cap)."""
    max_body_bytes: int = option(8 * 1024 * 1024, "largest accepted request body (HTTP 413 above)", ge=1024)
    """Largest accepted request body; larger ones get HTTP 413."""
    health_interval_s: float = option(2.0, "seconds between active health checks", gt=0)
    """Seconds between active health checks of each instance."""
    health_failures: int = option(2, "consecutive failures before an instance is unhealthy", ge=1)
    """Consecutive failed checks (or failed requests) before an instance is marked unhealthy."""
    loads_interval_s: float = option(1.0, "seconds between /v1/loads polls (0: off)", ge=0)
    """Seconds between polls of each instance's /v1/loads (0 disables polling)."""
    load_window_s: float = option(30.0, "seconds of measured TTFT/TPOT in the 'actual' part of SLO Load", gt=0)
    """Window (seconds) over which measured TTFT/TPOT make up the 'actual' half of SLO Load."""
    scale_interval_s: float = option(5.0, "seconds between scaling decisions (0: controller off)", ge=0)
    """Seconds between scaling-controller decisions (0 disables the controller)."""
    scale_up_load: float = option(0.9, "SLO Load above which a pool scales up")
    """Scale a pool up when its SLO Load stays above this for scale_up_sustain_s."""
    scale_urgent_load: float = option(
        0.0, "predicted Load above which a pool scales up at once, without the sustain (0: off)")
    """Predicted Load (backlog over measured rates) above which a pool scales up without waiting for
    scale_up_sustain_s (0: off)."""
    scale_role_switch: bool = option(
        False, "lend idle instances between the prefill and decode pools via /pd_role_switch")
    """Meet a PD pool's shortage by flipping an idle instance of the other pool (SGLang's
    /pd_role_switch; instances need --enable-pd-role-switch) before starting a new one."""
    scale_down_load: float = option(0.4, "SLO Load (with one instance fewer) below which a pool scales down")
    """Scale a pool down when its SLO Load (as it would be with one instance fewer) stays below this."""
    scale_up_sustain_s: float = option(10.0, "how long Load must stay high before scaling up", ge=0)
    """How long Load must stay above scale_up_load before adding an instance."""
    scale_down_sustain_s: float = option(60.0, "how long Load must stay low before scaling down", ge=0)
    """How long Load must stay below scale_down_load before removing an instance."""
    scale_cooldown_s: float = option(30.0, "minimum seconds between two scaling actions on a pool", ge=0)
    """Minimum time between two scaling actions on the same pool."""
    min_instances: int = option(1, "minimum instances per pool", ge=0)
    """Never scale a pool below this many instances."""
    max_instances: int = option(4, "maximum instances per pool")
    """Never scale a pool above this many instances."""
    drain_timeout_s: float = option(120.0, "longest wait for in-flight requests when removing an instance", ge=0)
    """Longest wait for in-flight requests on an instance being removed."""
    min_prefill_instances: int = option(-1, "minimum of the prefill pool (-1: min_instances)")
    """Minimum of the prefill pool (-1: min_instances)."""
    min_decode_instances: int = option(-1, "minimum of the decode pool (-1: min_instances)")
    """Minimum of the decode pool (-1: min_instances)."""
    scale_trend_lookahead_s: float = option(
        0.0, "seconds to extrapolate predicted Load along its slope before comparing (0: off)", ge=0)
    """Extrapolate each pool's predicted Load this many seconds along its recent slope; the
    projection counts as high Load (about an instance's start-up time; 0: off)."""
    scale_trend_window_s: float = option(30.0, "seconds of predicted-Load samples the slope is fitted on", gt=0)
    """Seconds of predicted-Load samples the slope is fitted on."""
    scale_down_after_up_s: float = option(
        0.0, "no scale-down within this many seconds after the pool's last scale-up", ge=0)
    """No scale-down of a pool within this many seconds after its last scale-up."""

    def pool_minimum(self, role: str) -> int:
        """The minimum of one pool ("prefill", "decode" or "plain")."""
        own = {"prefill": self.min_prefill_instances, "decode": self.min_decode_instances}.get(role, -1)
        return self.min_instances if own < 0 else own

    def __post_init__(self) -> None:
        check_config(self)  # the ranges declared above and the policy's choices
        if self.scale_urgent_load and self.scale_urgent_load <= self.scale_up_load:
            raise ValueError(f"scale_urgent_load must be 0 or > scale_up_load, got {self.scale_urgent_load}")
        if not 0 <= self.scale_down_load < self.scale_up_load:
            raise ValueError(
                f"scale_down_load must be in [0, scale_up_load), got {self.scale_down_load} "
                f"(scale_up_load={self.scale_up_load})"
            )
        for name in ("min_prefill_instances", "min_decode_instances"):
            if not -1 <= getattr(self, name) <= self.max_instances:
                raise ValueError(f"{name} must be -1 or in [0, max_instances], got {getattr(self, name)}")
        if self.max_instances < max(1, self.min_instances):
            raise ValueError(
                f"max_instances must be >= max(1, min_instances), got {self.max_instances}"
            )
