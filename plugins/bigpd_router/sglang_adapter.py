"""Layer: SGLang adapter of bigpd_router. The only module of the plugin that touches SGLang objects.

The router itself never imports SGLang. Inside SGLang processes the plugin does one thing: let
PD disaggregation with the Mooncake transfer engine run on a CPU-only machine (TCP transport).
In 0.5.23 the prefill side's `_send_kv_chunk` takes a fast path for senders that declare
`supports_host_tensor_indices` (Mooncake does): it allocates pinned memory and records a
`torch.cuda.Event`, which fails without a CUDA driver. Clearing the flag on CPU-only processes
makes SGLang take its other, device-agnostic path (`kv_to_page_indices`).
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("kllm.bigpd_router.adapter")


def mooncake_cpu_indices() -> Callable[[], bool]:
    """Registration callable (PatchSpec kind="registry"): returns a checker."""
    import torch
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    if torch.cuda.is_available():
        return lambda: True  # nothing to change where CUDA exists
    MooncakeKVSender.supports_host_tensor_indices = False
    log.debug("MooncakeKVSender.supports_host_tensor_indices cleared (no CUDA in this process)")
    return lambda: MooncakeKVSender.supports_host_tensor_indices is False
