"""Layer: hardware, CPU platform; SGLang adapter. What SGLang 0.5.23's HiCache needs to run on a
platform without pinned memory and without sgl-kernel:

- host pools built unpinned: `HostKVCache.__init__` asks for `pin_memory=True`
  (cudaHostRegister), which fails without CUDA;
- torch versions of the `direct` I/O ops (`transfer_kv_direct` and the two page-first/layer-first
  variants, `kv_direct_copy.py`) and of the default `kernel` I/O ops for the `layer_first` and
  `page_first` layouts (`kv_kernel_copy.py`), which `pool_host.mha` imports from sgl-kernel only
  on CUDA/HIP/XPU (without them the first L2 write raises `NameError`).

They belong to the platform, not to a plugin: `patches.py` lists them and the host applies that
list in every SGLang process when the CPU platform is selected, so stock HiCache runs on the CPU
platform with or without any plugin.
"""
from __future__ import annotations

from typing import Any, Callable

from kllm_plugins.hardware.cpu.kv_kernel_copy import KERNEL_OPS

DIRECT_OPS = ("transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf")


def unpin_host_pool(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE `HostKVCache.__init__`: ask for an unpinned pool where the platform has no pinned
    memory; leave the call alone elsewhere."""
    from sglang.srt.platforms import current_platform

    if current_platform.is_pin_memory_available():
        return None
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return args, kwargs


def bind_direct_copy() -> Callable[[], bool]:
    """Bind the torch `direct` and `kernel` I/O ops into `pool_host.mha` where sgl-kernel left
    them unbound; returns a check that all of them are callable."""
    from sglang.srt.mem_cache.pool_host import mha

    from kllm_plugins.hardware.cpu import kv_direct_copy, kv_kernel_copy

    for module, names in ((kv_direct_copy, DIRECT_OPS), (kv_kernel_copy, KERNEL_OPS)):
        for name in names:
            if not hasattr(mha, name):
                setattr(mha, name, getattr(module, name))
    return lambda: all(callable(getattr(mha, n, None)) for n in (*DIRECT_OPS, *KERNEL_OPS))
