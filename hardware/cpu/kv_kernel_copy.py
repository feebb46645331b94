"""Layer: hardware, CPU platform (plain torch, no SGLang import). Torch versions of HiCache's
`kernel` I/O ops for the `layer_first` and `page_first` host layouts.

HiCache's default I/O backend (`--hicache-io-backend kernel`) moves KV rows between device and
host pools with `sgl_kernel.kvcacheio` ops that `pool_host.mha` imports only on CUDA/HIP/XPU, so
on the CPU platform the names are unbound and the first L2 write fails (`NameError`). These are
the same row copies in torch. SGLang calls some of them with tensors and some with *pointer
tables* (uint64 tensors of `data_ptr()`s, one per layer, device rows packed at `item_size` bytes);
on the CPU platform every pointer is host memory, so a table entry is read as a byte view of the
rows it addresses. The `page_head` layout (heads split across pages) has no op here: the CPU
platform refuses it at start-up (`server_args_check.py`).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

#: every op of this module, as SGLang's pool_host.mha names it
KERNEL_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla_lf_pf",
)


def _long(idx: torch.Tensor) -> torch.Tensor:
    return idx.to(device="cpu", dtype=torch.long)


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] with contiguous trailing dims -> uint8 [N, row bytes] view (no copy)."""
    rows = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
    if rows.stride(-1) != 1:
        raise ValueError("kv_kernel_copy: rows must be contiguous within themselves")
    return rows.view(torch.uint8)


def _rows_at(ptr: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 [num_rows, row_bytes] view of packed host memory at `ptr`."""
    buf = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, row_bytes)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, si: torch.Tensor, di: torch.Tensor) -> None:
    if si.numel() != di.numel():
        raise ValueError(f"kv_kernel_copy: {si.numel()} source rows but {di.numel()} destination rows")
    dst[di] = src[si].to(dtype=dst.dtype)


def _ptr_rows(ptrs: torch.Tensor, layer: int, idx: torch.Tensor, row_bytes: int) -> torch.Tensor:
    return _rows_at(int(ptrs[layer].item()), int(idx.max().item()) + 1, row_bytes)


def transfer_kv_per_layer(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                          src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int, **_: Any) -> None:
    """One layer, layer-first to layer-first (host layer view -> device layer)."""
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel() == 0:
        return
    _copy_rows(src_k, dst_k, si, di)
    _copy_rows(src_v, dst_v, si, di)


def transfer_kv_per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                                src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int, item_size: int,
                                src_layout_dim: int = 0, **_: Any) -> None:
    """One layer from a page-first host pool ([tokens, layers, ...]) to a device layer."""
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel() == 0:
        return
    _copy_rows(src_k[:, layer_id], dst_k, si, di)
    _copy_rows(src_v[:, layer_id], dst_v, si, di)


def transfer_kv_all_layer(src_k_layers: torch.Tensor, dst_k_layers: torch.Tensor, src_v_layers: torch.Tensor,
                          dst_v_layers: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                          item_size: int, num_layers: int, **_: Any) -> None:
    """All layers, pointer table to pointer table (packed rows of `item_size` bytes on both sides)."""
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel() == 0:
        return
    for table_src, table_dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for layer in range(num_layers):
            src = _ptr_rows(table_src, layer, si, item_size)
            dst = _ptr_rows(table_dst, layer, di, item_size)
            _copy_rows(src, dst, si, di)


def transfer_kv_all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor, src_v_layers: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                item_size: int, dst_layout_dim: int = 0, num_layers: int = 0, **_: Any) -> None:
    """All layers, device pointer table to a page-first host pool ([tokens, layers, ...])."""
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel() == 0:
        return
    for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer in range(num_layers or dst.shape[1]):
            _copy_rows(_ptr_rows(table, layer, si, item_size), _byte_rows(dst[:, layer]), si, di)


def transfer_kv_per_layer_mla(src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
                              dst_indices: torch.Tensor, item_size: int = 0, **_: Any) -> None:
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel():
        _copy_rows(src, dst, si, di)


def transfer_kv_per_layer_mla_pf_lf(src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
                                    dst_indices: torch.Tensor, layer_id: int, item_size: int = 0,
                                    src_layout_dim: int = 0, **_: Any) -> None:
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel():
        _copy_rows(src[:, layer_id], dst, si, di)


def transfer_kv_all_layer_mla_lf_pf(src_layers: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
                                    dst_indices: torch.Tensor, item_size: int, dst_layout_dim: int = 0,
                                    num_layers: int = 0, **_: Any) -> None:
    si, di = _long(src_indices), _long(dst_indices)
    if si.numel() == 0:
        return
    for layer in range(num_layers or dst.shape[1]):
        _copy_rows(_ptr_rows(src_layers, layer, si, item_size), _byte_rows(dst[:, layer]), si, di)
