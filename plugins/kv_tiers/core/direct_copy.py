"""Layer: plugin core (plain torch, no SGLang import). Torch-native `transfer_kv_direct`.

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
