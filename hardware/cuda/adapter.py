"""Layer: hardware adapter (no SGLang import). NVIDIA CUDA through torch.cuda."""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from kllm_plugins.hardware.interface import DeviceAdapter


class CudaAdapter(DeviceAdapter):
    name = "cuda"
    device_type = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available() and torch.version.cuda is not None

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def stream_context(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def pin_memory_available(self) -> bool:
        return True

    def collective_backend(self) -> str:
        return "nccl"

    def kernels(self) -> dict[str, bool]:
        return {
            "torch_sdpa": True,
            "triton": importlib.util.find_spec("triton") is not None,
            "flashinfer": importlib.util.find_spec("flashinfer") is not None,
        }
