"""Layer: ring_cp core (plain torch, no SGLang import). Sparse top-k attention (DSA-style) under CP.

Each query attends only to the keys a light indexer selected for it (`topk_idx`, global token
ids of the packed batch, -1 = unused slot), over an MLA-style shared latent K/V (T, 1, D),
v = latent[..., :v_dim]. The indexer itself is outside this module: both paths take the same
indices. All-gather path: gather the whole latent, then gather each query's keys. Ring path:
bucket each query's selections by the (rank, chunk) that holds them once, then, as each chunk
arrives on the ring, attend to the selections that fall in it and merge by LSE.
"""
from __future__ import annotations

from typing import Any

import torch

from kllm_plugins.plugins.ring_cp.core.allgather_attention import GatherStats, gather_full_kv
from kllm_plugins.plugins.ring_cp.core.block_attn import default_scale
from kllm_plugins.plugins.ring_cp.core.lse_merge import PartialAttention
from kllm_plugins.plugins.ring_cp.core.ring_attention import RingStats, run_ring
from kllm_plugins.plugins.ring_cp.core.ring_comm import RingExchanger
from kllm_plugins.plugins.ring_cp.core.shard_plan import ShardPlan


def sparse_gather_attention(
    q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, scale: float, v_dim: int, q_chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Sq, H, D) against rows idx (Sq, m) of latent (Sk, 1, D); -1 entries are skipped."""
    sq, h, _ = q.shape
    out = torch.zeros(sq, h, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((sq, h), float("-inf"), dtype=torch.float32, device=q.device)
    if idx.shape[1] == 0 or sq == 0:
        return out, lse
    flat = latent[:, 0]
    for lo in range(0, sq, q_chunk):
        hi = min(sq, lo + q_chunk)
        ix = idx[lo:hi].long()
        valid = ix >= 0
        kk = flat[ix.clamp(min=0)]  # (c, m, D)
        s = torch.matmul(q[lo:hi], kk.transpose(1, 2)).float() * scale  # (c, H, m)
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(l), torch.zeros_like(l), l)
        p = torch.exp(s - safe.unsqueeze(-1))
        out[lo:hi] = torch.matmul(p.to(kk.dtype), kk[..., :v_dim]).float()
        lse[lo:hi] = l
    return out, lse


def allgather_sparse_attention(
    q: torch.Tensor, latent: torch.Tensor, topk_idx: torch.Tensor, plan: ShardPlan, rank: int, *,
    group: Any | None = None, scale: float | None = None, v_dim: int | None = None,
    stats: GatherStats | None = None, q_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale if scale is not None else default_scale(q.shape[-1])
    v_dim = v_dim or latent.shape[-1]
    full = gather_full_kv([latent], plan, rank, group, stats if stats is not None else GatherStats())[0]
    out, lse = sparse_gather_attention(q, full, topk_idx, scale, v_dim, q_chunk)
    return out.to(q.dtype), lse


class TopkBuckets:
    """Each query's selections grouped by the (source rank, chunk) that holds the key.

    Built once per layer: group id per selection, a stable per-row sort by group, per-row
    offsets, and the largest count per (query block, group), so a ring step reads, for each
    block of `q_chunk` queries, a dense (q_chunk, that block's max count) matrix of
    chunk-buffer offsets, and skips blocks with no selection in the arriving chunk.
    """

    def __init__(self, topk_idx: torch.Tensor, plan: ShardPlan, chunks_per_shard: int, q_chunk: int) -> None:
        dev = topk_idx.device
        group_of = torch.full((plan.total,), -1, dtype=torch.int32, device=dev)
        local_of = torch.zeros((plan.total,), dtype=torch.int32, device=dev)
        self.ngroups = plan.world * chunks_per_shard
        self.q_chunk = q_chunk
        for s in range(plan.world):
            gidx = plan.global_index(s, dev)
            for c, pcs in enumerate(plan.chunk_pieces(s, chunks_per_shard)):
                off = 0
                for lo, hi in pcs:
                    group_of[gidx[lo:hi]] = s * chunks_per_shard + c
                    local_of[gidx[lo:hi]] = torch.arange(off, off + hi - lo, dtype=torch.int32, device=dev)
                    off += hi - lo
        valid = topk_idx >= 0
        safe = topk_idx.clamp(min=0).long()
        grp = torch.where(valid, group_of[safe], torch.full_like(group_of[safe], self.ngroups))
        order = torch.sort(grp, dim=1, stable=True).indices
        self.local_sorted = torch.gather(torch.where(valid, local_of[safe], -1), 1, order).to(torch.int32)
        del order, safe
        counts = torch.zeros(topk_idx.shape[0], self.ngroups + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(1, grp.long(), torch.ones_like(grp, dtype=torch.int32))
        self.counts = counts[:, : self.ngroups]
        self.starts = (torch.cumsum(counts, dim=1) - counts)[:, : self.ngroups]
        nq = topk_idx.shape[0]
        nblk = -(-nq // q_chunk)
        padded = torch.zeros(nblk * q_chunk, self.ngroups, dtype=torch.int32, device=dev)
        padded[:nq] = self.counts
        self.block_max: list[list[int]] = padded.view(nblk, q_chunk, self.ngroups).amax(1).tolist() if nq else []

    def for_group(self, g: int, lo: int, hi: int, m: int) -> torch.Tensor:
        ar = torch.arange(m, device=self.counts.device, dtype=torch.int32)
        pos = self.starts[lo:hi, g : g + 1] + ar
        ok = ar < self.counts[lo:hi, g : g + 1]
        vals = torch.gather(self.local_sorted[lo:hi], 1, pos.clamp(max=self.local_sorted.shape[1] - 1).long())
        return torch.where(ok, vals, torch.full_like(vals, -1))


def ring_sparse_attention(
    q: torch.Tensor, latent: torch.Tensor, topk_idx: torch.Tensor, plan: ShardPlan, rank: int, *,
    group: Any | None = None, scale: float | None = None, v_dim: int | None = None,
    chunks_per_shard: int = 1, comm: bool = True, stats: RingStats | None = None, q_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale if scale is not None else default_scale(q.shape[-1])
    v_dim = v_dim or latent.shape[-1]
    stats = stats if stats is not None else RingStats()
    buckets = TopkBuckets(topk_idx, plan, chunks_per_shard, q_chunk)
    acc = PartialAttention(q.shape[0], q.shape[1], v_dim, q.device)
    own_pieces = plan.chunk_pieces(rank, chunks_per_shard)

    def attend(block: torch.Tensor, g: int) -> None:
        for b, lo in enumerate(range(0, q.shape[0], q_chunk)):
            m = buckets.block_max[b][g]
            if m == 0:
                continue
            hi = min(q.shape[0], lo + q_chunk)
            o, l = sparse_gather_attention(q[lo:hi], block, buckets.for_group(g, lo, hi, m), scale, v_dim, q_chunk)
            acc.merge(lo, hi, o, l)

    def compute_own() -> None:
        for c, pcs in enumerate(own_pieces):
            block = torch.cat([latent[lo:hi] for lo, hi in pcs]) if len(pcs) != 1 else latent[pcs[0][0] : pcs[0][1]]
            attend(block, rank * chunks_per_shard + c)

    def compute_remote(tensors: Any, src: int, c: int) -> None:
        attend(tensors[0], src * chunks_per_shard + c)

    exchanger = RingExchanger(group) if comm and plan.world > 1 else None
    run_ring([latent], plan, rank, chunks_per_shard, compute_own, compute_remote, exchanger, stats)
    return acc.result(q.dtype)
