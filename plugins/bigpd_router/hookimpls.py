"""Layer: hook implementations (no SGLang import). Declares the bigpd_router plugin to the host.

The router is a standalone service (`kllm-router`). Inside SGLang it only makes Mooncake PD
transfer usable on CPU-only hosts (see sglang_adapter). Its
options (declared once, on `RouterConfig`'s fields) still go through the host so they come from
`--kllm-bigpd-router-*` flags, `KLLM_BIGPD_ROUTER_*` variables or the `bigpd_router:` section of
the YAML config alike.
"""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.bigpd_router.config import RouterConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.bigpd_router.sglang_adapter"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="bigpd_router",
        summary="standalone router: global prefill/decode pools, per-request pairing, SLO Load, pool scaling",
        status="experimental",
        options=options_from_config(RouterConfig),
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
