"""Layer: hardware, CPU platform (plain torch, no SGLang import). Torch-native `transfer_kv_direct`.

HiCache's `direct` I/O backend moves KV rows between device and host pools with
`sgl_kernel.kvcacheio.transfer_kv_direct`, imported only on CUDA/HIP/XPU. On a platform
without sgl-kernel (the CPU platform) the name is unbound and the first L2 write fails. This
is the same operation in torch: for every (source layer, destination layer) pair, copy the
rows `src_indices` of the source into the rows `dst_indices` of the destination.
"""
from __future__ import annotations

from typing import Sequence

import torch


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int = 1,
) -> None:
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers but {len(dst_layers)} destinations")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"transfer_kv_direct: {src_indices.numel()} source rows but {dst_indices.numel()} destination rows"
        )
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        si = src_indices.to(device=src.device, dtype=torch.long)
        di = dst_indices.to(device=dst.device, dtype=torch.long)
        rows = src.index_select(0, si)
        dst.index_copy_(0, di, rows.to(device=dst.device, dtype=dst.dtype))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device (layer-first: K layers then V layers, each [rows, ...]) to a host pool in the
    `page_first_direct` layout (K and V, each [pages, layers, page_size, ...]), all layers."""
    if len(src_ptrs) % len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} source layers do not split over {len(dst_ptrs)} destinations")
    if src_indices.numel() == 0:
        return
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for part, dst in enumerate(dst_ptrs):
        di = dst_indices.to(device=dst.device, dtype=torch.long)
        pages, offs = di // page_size, di % page_size
        for layer in range(num_layers):
            src = src_ptrs[part * num_layers + layer]
            rows = src.index_select(0, src_indices.to(device=src.device, dtype=torch.long))
            dst[pages, layer, offs] = rows.to(device=dst.device, dtype=dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """One layer from a `page_first_direct` host pool (K, V) back to device rows (layer-first)."""
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_ptrs, dst_ptrs):
        si = src_indices.to(device=src.device, dtype=torch.long)
        rows = src[si // page_size, layer_id, si % page_size]
        dst.index_copy_(0, dst_indices.to(device=dst.device, dtype=torch.long), rows.to(device=dst.device, dtype=dst.dtype))
