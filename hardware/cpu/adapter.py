"""Layer: hardware adapter (no SGLang import). Host CPU: work runs inline, gloo for collectives."""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator

from kllm_plugins.hardware.interface import DeviceAdapter


class InlineStream:
    """CPU stand-in for a stream: operations run when issued."""

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class InlineEvent:
    """CPU stand-in for an event: complete as soon as it is recorded."""

    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: Any | None = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuAdapter(DeviceAdapter):
    name = "cpu"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def new_stream(self) -> InlineStream:
        return InlineStream()

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[Any]:
        yield stream

    def new_event(self) -> InlineEvent:
        return InlineEvent()

    def synchronize(self) -> None:
        return None

    def pin_memory_available(self) -> bool:
        return False

    def collective_backend(self) -> str:
        return "gloo"

    def kernels(self) -> dict[str, bool]:
        return {"torch_sdpa": True, "triton_interpret": importlib.util.find_spec("triton") is not None}
