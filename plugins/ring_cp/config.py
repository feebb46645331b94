"""Layer: plugin config (no SGLang import). Options of the ring_cp plugin."""
from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "sdpa_flash", "triton", "torch")


@dataclass(frozen=True)
class RingCPConfig:
    enable_ring: bool = True
    """Replace SGLang's zigzag all-gather prefill-CP attention with the ring (SGLang keeps --cp-strategy zigzag)."""
    chunks_per_shard: int = 4
    """K/V chunks per rank shard on the ring: per-rank K/V is 1/N of the sequence plus two chunks."""
    kernel: str = "auto"
    """Block attention: auto (sdpa_flash on CUDA, torch on CPU), sdpa_flash, triton or torch."""
    keep_full_kv_in_pool: bool = True
    """Still all-gather K/V into each rank's pool after attention (decode, radix cache and PD need it today)."""

    def __post_init__(self) -> None:
        if not 1 <= self.chunks_per_shard <= 64:
            raise ValueError(f"chunks_per_shard must be in [1, 64], got {self.chunks_per_shard}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if not isinstance(self.enable_ring, bool) or not isinstance(self.keep_full_kv_in_pool, bool):
            raise ValueError("enable_ring and keep_full_kv_in_pool must be booleans")
