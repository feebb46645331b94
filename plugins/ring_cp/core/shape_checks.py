"""Layer: ring_cp core (plain torch, no SGLang import). Input checks at the attention entry points.

The ring and all-gather paths slice, reshape and exchange tensors deep inside their schedules, so
a bad shape used to surface as a reshape or size-mismatch error far from its cause (14 query
heads over 4 KV heads failed with "shape '[10, 4, 3, -1]' is invalid"). Every public entry point
(`ring_attention`, `allgather_attention`, `ring_sparse_attention`, `allgather_sparse_attention`)
checks its inputs here first and raises `RingShapeError` (a ValueError) with one line naming the
quantity, the value found and the one expected.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kllm_plugins.plugins.ring_cp.core.shard_plan import ShardPlan


class RingShapeError(ValueError):
    """A ring_cp input whose shape, dtype or device cannot work; the message is one line."""


def _fail(msg: str) -> None:
    raise RingShapeError(f"ring_cp: {msg}")


def check_plan_rank(plan: ShardPlan, rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        _fail(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < plan.world:
        _fail(f"rank {rank} is outside the plan's world of {plan.world} ranks (0..{plan.world - 1})")


def _check_tensor(name: str, t: object, ndim: int, layout_hint: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor {layout_hint}, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D {layout_hint}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        _fail(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t


def check_query(q: object, plan: ShardPlan, rank: int) -> torch.Tensor:
    """q: (T_local, H, Dk) with T_local = the plan's local length for `rank`."""
    check_plan_rank(plan, rank)
    qt = _check_tensor("q", q, 3, "(tokens, heads, head_dim)")
    want = plan.local_len(rank)
    if qt.shape[0] != want:
        _fail(f"q has {qt.shape[0]} tokens but the plan gives rank {rank} {want} "
              f"(seq_lens {list(plan.seq_lens)}, world {plan.world}, {plan.mode})")
    if qt.shape[1] < 1 or qt.shape[2] < 1:
        _fail(f"q needs at least one head and a head_dim >= 1, got shape {tuple(qt.shape)}")
    return qt


def _check_same_place(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        _fail(f"{name} is on {t.device} but q is on {q.device}")
    if t.dtype != q.dtype:
        _fail(f"{name} is {t.dtype} but q is {q.dtype} (cast both to one dtype)")


def check_dense_inputs(
    q: object, payload: Sequence[object], plan: ShardPlan, rank: int, layout: str, v_dim: int | None,
    tokens: int | None = None,
) -> None:
    """Check a dense ring/all-gather call. `tokens` is the K/V length expected (default: rank's shard)."""
    qt = check_query(q, plan, rank)
    h, dk = qt.shape[1], qt.shape[2]
    want_t = qt.shape[0] if tokens is None else tokens  # check_query matched it to the plan
    where = f"rank {rank}'s shard" if tokens is None else "the full batch"
    if layout == "kv":
        if len(payload) != 2:
            _fail(f"layout 'kv' takes (k, v), got {len(payload)} tensor(s)")
        k = _check_tensor("k", payload[0], 3, "(tokens, kv_heads, head_dim)")
        v = _check_tensor("v", payload[1], 3, "(tokens, kv_heads, v_head_dim)")
        for name, t in (("k", k), ("v", v)):
            _check_same_place(name, t, qt)
            if t.shape[0] != want_t:
                _fail(f"{name} has {t.shape[0]} tokens but {where} has {want_t}")
        hkv = k.shape[1]
        if v.shape[1] != hkv:
            _fail(f"k has {hkv} KV heads but v has {v.shape[1]}")
        if hkv < 1 or h % hkv != 0:
            _fail(f"{h} query heads are not a multiple of {hkv} KV heads "
                  f"(grouped-query attention needs query_heads % kv_heads == 0)")
        if k.shape[2] != dk:
            _fail(f"k's head_dim {k.shape[2]} differs from q's {dk}")
        if v_dim is not None and v_dim != v.shape[2]:
            _fail(f"v_dim={v_dim} but v's head_dim is {v.shape[2]} (v_dim applies to layout 'latent' only)")
    elif layout == "latent":
        if len(payload) != 1:
            _fail(f"layout 'latent' takes (latent,), got {len(payload)} tensor(s)")
        check_latent(payload[0], qt, want_t, where, v_dim)
    else:
        _fail(f"layout must be 'kv' or 'latent', got {layout!r}")


def check_latent(latent: object, q: torch.Tensor, want_t: int, where: str, v_dim: int | None) -> None:
    c = _check_tensor("latent", latent, 3, "(tokens, 1, latent_dim)")
    _check_same_place("latent", c, q)
    if c.shape[1] != 1:
        _fail(f"latent must have one shared head (tokens, 1, latent_dim), got {c.shape[1]} heads")
    if c.shape[0] != want_t:
        _fail(f"latent has {c.shape[0]} tokens but {where} has {want_t}")
    if c.shape[2] != q.shape[2]:
        _fail(f"latent_dim {c.shape[2]} differs from q's head_dim {q.shape[2]}")
    if v_dim is not None and not 1 <= v_dim <= c.shape[2]:
        _fail(f"v_dim={v_dim} must be in 1..{c.shape[2]} (the latent_dim)")


def check_sparse_inputs(
    q: object, latent: object, topk_idx: object, plan: ShardPlan, rank: int, v_dim: int | None,
    tokens: int | None = None,
) -> None:
    """Check a sparse top-k call: latent K/V, indices (T_local, m) of global token ids or -1."""
    qt = check_query(q, plan, rank)
    want_t = qt.shape[0] if tokens is None else tokens  # check_query matched it to the plan
    where = f"rank {rank}'s shard" if tokens is None else "the full batch"
    check_latent(latent, qt, want_t, where, v_dim)
    if not isinstance(topk_idx, torch.Tensor):
        _fail(f"topk_idx must be a torch.Tensor (queries, top_k), got {type(topk_idx).__name__}")
    assert isinstance(topk_idx, torch.Tensor)
    if topk_idx.dim() != 2 or topk_idx.shape[0] != qt.shape[0]:
        _fail(f"topk_idx must be ({qt.shape[0]}, top_k) for {qt.shape[0]} local queries, "
              f"got shape {tuple(topk_idx.shape)}")
    if topk_idx.is_floating_point() or topk_idx.dtype == torch.bool:
        _fail(f"topk_idx must hold integer token ids, got {topk_idx.dtype}")
    if topk_idx.device != qt.device:
        _fail(f"topk_idx is on {topk_idx.device} but q is on {qt.device}")


def check_chunks(chunks_per_shard: object) -> None:
    if not isinstance(chunks_per_shard, int) or isinstance(chunks_per_shard, bool) or chunks_per_shard < 1:
        _fail(f"chunks_per_shard must be an int >= 1, got {chunks_per_shard!r}")


def check_group(plan: ShardPlan, group: object | None) -> None:
    """The process group the ring runs over must have the plan's world size."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        _fail(f"the plan spans {plan.world} ranks but torch.distributed is not initialized "
              f"(init a process group, or pass comm=False for a compute-only run)")
    size = dist.get_world_size(group)  # type: ignore[arg-type]
    if size != plan.world:
        _fail(f"the process group has {size} ranks but the plan was built for {plan.world}")
