"""Layer: ring_cp core (plain torch, no SGLang import). The all-gather CP baseline, in our code.

It follows SGLang 0.5.23's zigzag strategy (`ZigzagCPStrategy.materialize_full_kv` and
`run_attention`): every rank pads its K/V shard to the longest shard, `all_gather_into_tensor`
collects all shards into every rank, the shards are reordered into full sequence order (the
full K/V that SGLang then writes into each rank's pool), and each local query block attends to
the full-K/V prefix that ends at its own last position (kv_len_prev / kv_len_next), causal
bottom-right aligned. Attention starts only after the gather completes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from kllm_plugins.plugins.ring_cp.core.block_attn import BlockAttention, default_scale, torch_block_attention
from kllm_plugins.plugins.ring_cp.core.lse_merge import PartialAttention
from kllm_plugins.plugins.ring_cp.core.ring_attention import KVLayout, kv_views, run_items
from kllm_plugins.plugins.ring_cp.core.shape_checks import check_dense_inputs, check_group
from kllm_plugins.plugins.ring_cp.core.shard_plan import ShardPlan


@dataclass
class GatherStats:
    gathered_bytes: int = 0
    """Bytes of the gather buffer (world x longest shard)."""
    full_kv_bytes: int = 0
    """Bytes of the reordered full-sequence K/V each rank keeps."""
    local_kv_bytes: int = 0

    @property
    def peak_kv_bytes(self) -> int:
        return self.local_kv_bytes + self.gathered_bytes + self.full_kv_bytes


def gather_full_kv(
    payload: Sequence[torch.Tensor], plan: ShardPlan, rank: int, group: Any | None, stats: GatherStats
) -> list[torch.Tensor]:
    """All-gather every rank's shard and return the packed full-batch K/V (one tensor per payload part)."""
    world = plan.world
    if world > 1:
        check_group(plan, group)
    lens = [plan.local_len(r) for r in range(world)]
    max_len = max(lens)
    stats.local_kv_bytes = sum(p.numel() * p.element_size() for p in payload)
    stats.gathered_bytes = stats.full_kv_bytes = 0
    full: list[torch.Tensor] = []
    for p in payload:
        x = p
        if x.shape[0] < max_len:
            x = torch.cat([x, x.new_zeros((max_len - x.shape[0], *x.shape[1:]))], dim=0)
        gathered = x.new_empty((max_len * world, *x.shape[1:]))
        if world > 1:
            dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        else:
            gathered.copy_(x)
        stats.gathered_bytes += gathered.numel() * gathered.element_size()
        f = reorder_gathered(gathered, plan, max_len)
        stats.full_kv_bytes += f.numel() * f.element_size()
        del gathered
        full.append(f)
    return full


def reorder_gathered(gathered: torch.Tensor, plan: ShardPlan, max_len: int) -> torch.Tensor:
    """Gather buffer (rank-major, each rank's shard padded to max_len) -> packed full-batch order.

    One slice copy per segment: no index tensor is built or moved to the device.
    """
    cu = plan.cu_seqlens()
    full = gathered.new_empty((plan.total, *gathered.shape[1:]))
    for r in range(plan.world):
        base = r * max_len
        for s in plan.segments[r]:
            dst = cu[s.seq] + s.start
            full[dst : dst + s.length].copy_(gathered[base + s.local : base + s.local + s.length])
    return full


def allgather_attention(
    q: torch.Tensor, payload: Sequence[torch.Tensor], plan: ShardPlan, rank: int, *,
    group: Any | None = None, causal: bool = True, scale: float | None = None,
    attn: BlockAttention | None = None, layout: KVLayout = "kv", v_dim: int | None = None,
    stats: GatherStats | None = None, full_kv: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ring_attention`; `full_kv` skips the gather (compute-only timing)."""
    if full_kv is None:
        check_dense_inputs(q, payload, plan, rank, layout, v_dim)
    else:
        check_dense_inputs(q, full_kv, plan, rank, layout, v_dim, tokens=plan.total)
    attn = attn or torch_block_attention
    scale = scale if scale is not None else default_scale(q.shape[-1])
    stats = stats if stats is not None else GatherStats()
    full = list(full_kv) if full_kv is not None else gather_full_kv(payload, plan, rank, group, stats)
    k, v = kv_views(full, layout, v_dim)
    cu = plan.cu_seqlens()
    acc = PartialAttention(q.shape[0], q.shape[1], v.shape[-1], q.device)
    items = []
    for s in plan.segments[rank]:
        base = cu[s.seq]
        kv_hi = base + (s.end if causal else plan.seq_lens[s.seq])
        items.append((s.local, s.local + s.length, base, kv_hi, causal))
    run_items(acc, q, k, v, items, attn, scale)
    return acc.result(q.dtype)
