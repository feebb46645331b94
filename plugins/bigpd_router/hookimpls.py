"""Layer: hook implementations (no SGLang import). Declares the bigpd_router plugin to the host.

The router is a standalone service (`kllm-router`). Inside SGLang it only makes Mooncake PD
transfer usable on CPU-only hosts (see sglang_adapter). Its
options still go through the host so they come from `--kllm-bigpd-router-*` flags,
`KLLM_BIGPD_ROUTER_*` variables or the `bigpd_router:` section of the YAML config alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.bigpd_router.config import POLICIES, RouterConfig
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec, parse_bool

ADAPTER = "kllm_plugins.plugins.bigpd_router.sglang_adapter"

_HELP = {
    "ttft_target_s": "TTFT SLO target in seconds (Load_P denominator)",
    "tpot_target_s": "TPOT SLO target in seconds per token (Load_D denominator)",
    "policy": "instance choice: slo_affinity, round_robin or least_load",
    "affinity_weight": "trust in the approximate prefix tree (1: a matched prefix counts as cached)",
    "affinity_block_chars": "prompt characters per block of the approximate prefix tree",
    "affinity_max_blocks": "blocks kept in the approximate prefix tree (LRU)",
    "kv_events": "subscribe to instances' KV events (--kv-events-config) and route prefills on them",
    "tokenizer_path": "tokenizer for KV-event lookups of text prompts (default: the instances' own, if present)",
    "request_timeout_s": "whole-request timeout toward an instance",
    "first_token_timeout_s": "time to the first byte before retrying elsewhere",
    "max_retries": "retries on another instance when one fails before the first token",
    "max_body_bytes": "largest accepted request body (HTTP 413 above)",
    "stall_timeout_s": "longest silence between two pieces of a started stream before it ends with an error",
    "poison_quarantine_s": "seconds an identical request that crashed two instances is refused (HTTP 422)",
    "validate_inputs": "refuse token ids outside the vocabulary and prompts over the context (HTTP 400)",
    "liveness_interval_s": "seconds between liveness probes of each instance (0: off)",
    "liveness_timeout_s": "a liveness probe unanswered this long is a miss",
    "liveness_failures": "missed liveness probes in a row before an instance is marked down",
    "header_timeout_s": "seconds a client has to send a request head (HTTP 408)",
    "body_timeout_s": "seconds a client has to send a request body (HTTP 408)",
    "idle_timeout_s": "seconds before an idle keep-alive client connection is closed",
    "max_client_connections": "open connections allowed per client address (0: no cap)",
    "health_interval_s": "seconds between active health checks",
    "health_failures": "consecutive failures before an instance is unhealthy",
    "loads_interval_s": "seconds between /v1/loads polls (0: off)",
    "load_window_s": "seconds of measured TTFT/TPOT in the 'actual' part of SLO Load",
    "scale_interval_s": "seconds between scaling decisions (0: controller off)",
    "scale_up_load": "SLO Load above which a pool scales up",
    "scale_urgent_load": "predicted Load above which a pool scales up at once, without the sustain (0: off)",
    "scale_role_switch": "lend idle instances between the prefill and decode pools via /pd_role_switch",
    "scale_down_load": "SLO Load (with one instance fewer) below which a pool scales down",
    "scale_up_sustain_s": "how long Load must stay high before scaling up",
    "scale_down_sustain_s": "how long Load must stay low before scaling down",
    "scale_cooldown_s": "minimum seconds between two scaling actions on a pool",
    "min_instances": "minimum instances per pool",
    "max_instances": "maximum instances per pool",
    "drain_timeout_s": "longest wait for in-flight requests when removing an instance",
    "min_prefill_instances": "minimum of the prefill pool (-1: min_instances)",
    "min_decode_instances": "minimum of the decode pool (-1: min_instances)",
    "scale_trend_lookahead_s": "seconds to extrapolate predicted Load along its slope before comparing (0: off)",
    "scale_trend_window_s": "seconds of predicted-Load samples the slope is fitted on",
    "scale_down_after_up_s": "no scale-down within this many seconds after the pool's last scale-up",
}


def _options() -> tuple[OptionSpec, ...]:
    out = []
    for f in dataclasses.fields(RouterConfig):
        default = f.default
        typ = parse_bool if isinstance(default, bool) else type(default)
        out.append(OptionSpec(f.name, typ, default, _HELP[f.name],
                              choices=POLICIES if f.name == "policy" else None))
    return tuple(out)


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="bigpd_router",
        summary="standalone router: global prefill/decode pools, per-request pairing, SLO Load, pool scaling",
        status="experimental",
        options=_options(),
        patches=(
            PatchSpec(
                target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender",
                impl=f"{ADAPTER}:mooncake_cpu_indices",
                kind="registry",
                why="PD with Mooncake on a CPU-only host: the prefill's host-index fast path pins memory and "
                    "records a torch.cuda.Event; clearing MooncakeKVSender.supports_host_tensor_indices (a class "
                    "flag, not a registry) makes SGLang use its device-agnostic index path",
                upstream="gate supports_host_tensor_indices (prefill.py _send_kv_chunk) on the KV device being CUDA",
            ),
        ),
        config_factory=RouterConfig,
    )


@hookimpl
def kllm_readiness(config: Any, server_args: Any) -> str | None:
    """Inside a server the plugin only adapts Mooncake PD transfer; the router is `kllm-router`."""
    mode = getattr(server_args, "disaggregation_mode", "null")
    backend = getattr(server_args, "disaggregation_transfer_backend", "mooncake")
    if mode not in ("prefill", "decode") or backend != "mooncake":
        return ("in a server bigpd_router only adapts Mooncake PD transfer, which is off "
                f"(disaggregation_mode={mode}, transfer backend {backend}); add --disaggregation-mode prefill|decode "
                "--disaggregation-transfer-backend mooncake, and run the router itself as `kllm-router`")
    return None
