"""Shared fixtures: offline models, SGLang availability, GPU skipping.

Servers are owned by fixtures (module scope) and stopped by them; nothing global.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import pytest

HAS_SGLANG = importlib.util.find_spec("sglang") is not None

# SGLang resolves its platform once per process and caches it. Tests that build real SGLang
# objects in this process need the CPU platform, whichever test touches SGLang first; a
# platform chosen by the user (e.g. on a GPU machine) is kept.
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("SGLANG_PLATFORM", "kllm_cpu")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (none in CI)")
    no_multi = pytest.mark.skip(reason="needs two or more GPUs")
    no_sglang = pytest.mark.skip(reason="SGLang is not installed")
    gpus = None
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            gpus = _gpu_count() if gpus is None else gpus
            if gpus == 0:
                item.add_marker(no_gpu)
            elif "multi_gpu" in item.keywords and gpus < 2:
                item.add_marker(no_multi)
        if ("sglang" in item.keywords or "e2e" in item.keywords) and not HAS_SGLANG:
            item.add_marker(no_sglang)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from kllm_plugins.models.tiny_llama import tiny_llama_path

    return tiny_llama_path()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kllm_plugins.models.smollm2 import smollm2_path

    return smollm2_path()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No KLLM_* / SGLANG_PLATFORM variables leak into a test."""
    import os

    for key in list(os.environ):
        if key.startswith("KLLM_") or key in ("SGLANG_PLATFORM", "SGLANG_PLUGINS"):
            monkeypatch.delenv(key)
    yield monkeypatch


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench_module() -> Callable[[str, str], ModuleType]:
    """Loads `benchmarks/<folder>/<name>.py` as a module (its folder on sys.path while it imports,
    as when run as a script), for tests of what a benchmark's recorded figures rest on."""

    def load(folder: str, name: str) -> ModuleType:
        where = BENCHMARKS / folder
        sys.path.insert(0, str(where))
        try:
            spec = importlib.util.spec_from_file_location(f"kllm_test_{folder}_{name}", where / f"{name}.py")
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses look their module up
            spec.loader.exec_module(mod)
            return mod
        finally:
            sys.path.remove(str(where))

    return load
