"""Layer: SGLang adapter for NVIDIA GPUs without sgl-kernel. The `kllm_cuda` out-of-tree platform.

Device `cuda`; SGLang's Triton attention backend by default (`--attention-backend torch_native`
is the fallback); torch-native fused ops (dispatch key `native`: SGLang's BaseFusedOp and its
out-of-tree checks route norms, rotary embedding and activations to their torch forms); PyTorch
sampling (no FlashInfer); NCCL through torch.distributed (no PyNccl); HiCache host pools without
the sgl-kernel staging kernels (`hicache_device_kernels=False`), so their `direct` copies run as
torch ops, or through kv_tiers' staged copier when that plugin is on. CUDA graphs: off unless
`KLLM_CUDA_GRAPHS=1` (then SGLang's own decode graph runner captures them); start the server with
`--disable-cuda-graph` otherwise (no piecewise prefill graphs either way).

SGLang's `is_cuda()` is False on this platform (the process-start guard, kllm_cuda_guard.py);
the class logs what it chose (GPU, graphs, TreeCore), once per process, through the host's `kllm`
log handler: SGLang resolves its platform while importing its modules, before it configures logging
and before the host's plugin entry point runs, so without that handler the INFO line would be lost.
"""
from __future__ import annotations

import logging
import os

import torch
from sglang.srt.platforms.cuda import CudaDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger("kllm.cuda")

GRAPHS_ENV = "KLLM_CUDA_GRAPHS"


def graphs_enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


class KllmCudaPlatform(CudaDeviceMixin, SRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cuda"
    device_type = "cuda"
    capabilities = PlatformCapabilities(
        supports_triton=True,
        graph_capture=graphs_enabled(),
        piecewise_graph=False,
        hicache_device_kernels=False,
        supports_pynccl=False,
    )

    def __init__(self) -> None:
        super().__init__()
        import kllm_cuda_guard

        from kllm_plugins.sglang_bridge import _setup_logging

        _setup_logging()  # idempotent: the host's stderr handler on the `kllm` logger

        backend, reason = kllm_cuda_guard.tree_core()
        logger.info(
            "kllm_cuda platform (pid %d): %s, torch %s, CUDA graphs %s, TreeCore %s (%s)",
            os.getpid(), torch.cuda.get_device_name(0), torch.__version__,
            "on" if self.capabilities.graph_capture else "off", backend, reason,
        )

    def get_default_attention_backend(self) -> str:
        return "triton"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "triton"

    def get_speculative_cache_locs_fn(self):
        """SGLang's Triton kernel for speculative write windows (its `is_cuda()` gate is False here)."""
        from kllm_plugins.hardware.cuda.spec_cache_locs import assign_extend_cache_locs

        return assign_extend_cache_locs

    def get_graph_runner_cls(self):
        if not self.capabilities.graph_capture:
            return None
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        return DecodeCudaGraphRunner

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "eager"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)
