"""Layer: hardware selection (no SGLang import).

`KLLM_DEVICE` picks an adapter explicitly (cpu, cuda); otherwise CUDA when present, else CPU.
"""
from __future__ import annotations

import os

from kllm_plugins.hardware.cpu.adapter import CpuAdapter
from kllm_plugins.hardware.cuda.adapter import CudaAdapter
from kllm_plugins.hardware.interface import DeviceAdapter

_ADAPTERS: dict[str, type[DeviceAdapter]] = {"cpu": CpuAdapter, "cuda": CudaAdapter}


def available_adapters() -> dict[str, bool]:
    return {name: cls().is_available() for name, cls in _ADAPTERS.items()}


def get_adapter(name: str | None = None) -> DeviceAdapter:
    name = name or os.environ.get("KLLM_DEVICE") or None
    if name is not None:
        if name not in _ADAPTERS:
            raise ValueError(f"unknown KLLM_DEVICE {name!r}; valid choices: {', '.join(_ADAPTERS)}")
        adapter = _ADAPTERS[name]()
        if not adapter.is_available():
            raise RuntimeError(f"KLLM_DEVICE={name} but that device is not available in this process")
        return adapter
    cuda = CudaAdapter()
    return cuda if cuda.is_available() else CpuAdapter()
