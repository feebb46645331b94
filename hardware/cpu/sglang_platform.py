"""Layer: SGLang adapter for the CPU. A torch-native out-of-tree SGLang platform.

SGLang's own out-of-tree checks route norms, rotary embedding, activations, the paged
allocator and graph capture to their native torch paths for an OOT platform, so the class
only has to declare what it is: torch_native attention, eager compilation, no pinned memory,
no Triton, no graph capture, gloo collectives on CPU.
"""
from __future__ import annotations

import os

import psutil
import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class KllmCpuPlatform(CpuDeviceMixin, SRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_device(self, device_id: int | None = 0) -> str:
        # SGLang's utils.get_device() returns this as the server's device string and
        # later calls .split(":") on it, so it must be a str, not a torch.device.
        return "cpu"

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "eager"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_device_total_memory(self, device_id: int = 0) -> int:
        limit = os.environ.get("KLLM_CPU_MEMORY_BYTES")
        return int(limit) if limit else int(psutil.virtual_memory().total)
