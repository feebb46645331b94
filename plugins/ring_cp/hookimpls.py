"""Layer: hook implementations (no SGLang import). Declares the ring_cp plugin to the host."""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.ring_cp.config import RingCPConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.ring_cp.sglang_adapter"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="ring_cp",
        summary="ring-attention context parallelism for long prefill (K/V chunks travel a ring, LSE merge)",
        status="experimental",
        options=options_from_config(RingCPConfig),
        patches=(
            PatchSpec(
                target="sglang.srt.layers.cp.base.init_cp_strategy",
                impl=f"{ADAPTER}:around_init_cp_strategy",
                kind="around",
                why="swap the process-wide zigzag CP strategy for RingCPStrategy; cp_strategy choices are closed",
                upstream="a registry of CP strategies (or open --cp-strategy choices) in sglang.srt.layers.cp.base",
            ),
        ),
        config_factory=RingCPConfig,
    )


@hookimpl
def kllm_validate(config: Any, enabled: list[str]) -> None:
    if isinstance(config, RingCPConfig) and config.enable_ring and not config.keep_full_kv_in_pool:
        raise ValueError(
            "ring_cp: keep_full_kv_in_pool=false is not supported yet: SGLang's decode, radix cache and PD "
            "transfer read the full K/V from each CP rank's pool"
        )


RING_FLAGS = "--attn-cp-size N --enable-prefill-cp --cp-strategy zigzag (N > 1 CUDA GPUs, FlashAttention backend)"


@hookimpl
def kllm_readiness(config: Any, server_args: Any) -> str | None:
    """The ring replaces SGLang's zigzag prefill-CP strategy, which exists only with prefill CP on."""
    if isinstance(config, RingCPConfig) and not config.enable_ring:
        return "--kllm-ring-cp-enable-ring is false; the zigzag strategy is left as it is"
    cp = int(getattr(server_args, "attn_cp_size", 1) or 1)
    if cp <= 1 or not getattr(server_args, "enable_prefill_cp", False):
        return f"ring_cp replaces SGLang's prefill context parallelism, which is off (attn_cp_size={cp}); add {RING_FLAGS}"
    strategy = getattr(server_args, "cp_strategy", None)
    if strategy not in (None, "zigzag"):
        return f"ring_cp replaces the zigzag CP strategy, not --cp-strategy {strategy}; use --cp-strategy zigzag"
    return None
