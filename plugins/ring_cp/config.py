"""Layer: plugin config (no SGLang import). Options of the ring_cp plugin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kllm_plugins.spec import check_config, option

Kernel = Literal["auto", "sdpa_flash", "triton", "torch"]
KERNELS: tuple[str, ...] = get_args(Kernel)


@dataclass(frozen=True)
class RingCPConfig:
    enable_ring: bool = option(True, "use the ring for prefill CP attention (keep --cp-strategy zigzag)")
    """Replace SGLang's zigzag all-gather prefill-CP attention with the ring (SGLang keeps --cp-strategy zigzag)."""
    chunks_per_shard: int = option(4, "K/V chunks per rank shard on the ring", ge=1, le=64)
    """K/V chunks per rank shard on the ring: per-rank K/V is 1/N of the sequence plus two chunks."""
    kernel: Kernel = option("auto", "block attention implementation")
    """Block attention: auto (sdpa_flash on CUDA, torch on CPU), sdpa_flash, triton or torch."""
    keep_full_kv_in_pool: bool = option(
        True, "still write the full K/V into each rank's pool (needed by decode, radix cache, PD)")
    """Still all-gather K/V into each rank's pool after attention (decode, radix cache and PD need it today)."""

    def __post_init__(self) -> None:
        check_config(self)
        if not isinstance(self.enable_ring, bool) or not isinstance(self.keep_full_kv_in_pool, bool):
            raise ValueError("enable_ring and keep_full_kv_in_pool must be booleans")
