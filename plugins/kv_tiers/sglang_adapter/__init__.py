"""Layer: SGLang adapter of the kv_tiers plugin: the modules that touch SGLang, one per concern.

- `state`: the process-wide core `TierState` and its Prometheus meter;
- `file_storage`: `KllmFileStorage`, the file L3 backend (HiCache `dynamic` storage);
- `mooncake_storage` (and `mooncake_markers`): `KllmMooncakeStorage`, the Mooncake L3 backend;
- `prefetch`: the L3 prefetch gate, probe and just-in-time re-issue on HiCache's prefetch calls;
- `admission`: the admission hold of L3-loaded spans in HiCache's host tree;
- `measurement`: prefetch waits, L2 loads and prefill speed, for fetch or recompute;
- `events`: L3 tier events in SGLang's KV-event stream, the `kllm_tiers` publisher;
- `copier`: the staged L1<->L2 copier on HiCache's MHA host pool (CUDA).

Both backends are named by this package in HiCache's extra config
(`"module_path":"kllm_plugins.plugins.kv_tiers.sglang_adapter"`, `"class_name":"KllmFileStorage"`
or `"KllmMooncakeStorage"`); they are imported on first access, so that importing one hook
module does not import the Mooncake client.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"KllmFileStorage": "file_storage", "KllmMooncakeStorage": "mooncake_storage"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
