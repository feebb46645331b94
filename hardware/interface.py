"""Layer: hardware interface (no SGLang import). What plugins may ask of an accelerator.

Streams and events (or CPU stand-ins that run work inline), host buffers pinned where the
device supports it, asynchronous copies, the collective backend for torch.distributed, and
which optional kernels are present. Each adapter implements this once; plugin code never
branches on the device type itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch


class DeviceAdapter(ABC):
    name: str = "abstract"
    device_type: str = "cpu"

    @abstractmethod
    def is_available(self) -> bool:
        """Whether the hardware is present in this process."""

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    @abstractmethod
    def new_stream(self) -> Any:
        """A stream for side work (copies, communication); CPU returns an inline stand-in."""

    @abstractmethod
    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """Run enclosed work on `stream`."""

    @abstractmethod
    def new_event(self) -> Any:
        """An event with record(stream=None), synchronize(), query()."""

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def pin_memory_available(self) -> bool: ...

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor, page-locked when the device supports it (faster async copies)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory_available())

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any | None = None) -> None:
        """Copy src into dst without blocking the host where the device allows it."""
        if stream is None:
            dst.copy_(src, non_blocking=self.pin_memory_available())
            return
        with self.stream_context(stream):
            dst.copy_(src, non_blocking=self.pin_memory_available())

    @abstractmethod
    def collective_backend(self) -> str:
        """torch.distributed backend name: nccl on CUDA, gloo on CPU."""

    def kernels(self) -> dict[str, bool]:
        """Optional kernel families and whether they can run here."""
        return {}
