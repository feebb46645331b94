"""Layer: hardware, CPU platform; SGLang adapter. Refuses, at start-up and in one line, the server
arguments the `kllm_cpu` platform cannot serve, instead of letting the scheduler crash on its
first batch.

- HiCache: the host<->device copies exist in torch for `--hicache-io-backend kernel` with the
  `layer_first` / `page_first` layouts and for `direct` with `layer_first` / `page_first_direct`
  (`kv_kernel_copy.py`, `kv_direct_copy.py`); any other combination (`page_head`,
  `kernel_ascend`, ...) is refused, naming the four that work.
- Context parallelism (`--attn-cp-size` > 1): SGLang's CP attention lives in the CUDA backends
  (FlashAttention, TRT-LLM MHA, DSA); the platform's torch_native backend has no CP path, so
  the sharded queries meet unsharded K/V and the scheduler dies on a shape mismatch.

`check_input(record)` and `check(view)` are pure (they read attributes of the raw record / SGLang's
resolved view); `before_resolve_once` / `after_resolve_once` are the hooks on
`ServerArgs.resolve_once` listed in `patches.py`.
"""
from __future__ import annotations

from typing import Any

#: (io backend, host memory layout) pairs HiCache can move KV with on this platform
HICACHE_WORKING = (
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
)


def _working_list() -> str:
    return ", ".join(f"--hicache-io-backend {io} --hicache-mem-layout {layout}" for io, layout in HICACHE_WORKING)


def check_input(cfg: Any) -> str | None:
    """What the raw (unresolved) arguments ask for that kllm_cpu refuses before SGLang resolves
    them (SGLang's own CP checks are assertions with a traceback), or None."""
    cp = int(getattr(cfg, "attn_cp_size", 1) or 1)
    if cp > 1:
        return (f"kllm_cpu platform: --attn-cp-size {cp} is not supported: SGLang's context-parallel attention "
                "exists only in its CUDA backends (FlashAttention, TRT-LLM MHA, DSA) and the CPU's torch_native "
                "backend has none (use --attn-cp-size 1; ring_cp needs CUDA GPUs)")
    return None


def check(cfg: Any) -> str | None:
    """The one-line reason these (resolved) server arguments cannot run on kllm_cpu, or None."""
    if getattr(cfg, "enable_hierarchical_cache", False):
        pair = (getattr(cfg, "hicache_io_backend", None), getattr(cfg, "hicache_mem_layout", None))
        if pair not in HICACHE_WORKING:
            return (f"kllm_cpu platform: HiCache cannot move KV with --hicache-io-backend {pair[0]} "
                    f"--hicache-mem-layout {pair[1]} on the CPU; combinations that work: {_working_list()}")
    return check_input(cfg)


def before_resolve_once(self: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `ServerArgs.resolve_once`: refuse what the user's own arguments ask for."""
    if not getattr(self, "_resolution_finished", False):
        reason = check_input(self)
        if reason is not None:
            raise SystemExit(f"error: {reason}")
    return None


def after_resolve_once(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `ServerArgs.resolve_once`: stop start-up (one line, before any model loads) on
    arguments this platform cannot serve."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    reason = check(resolved_view(self))
    if reason is not None:
        raise SystemExit(f"error: {reason}")
    return result
