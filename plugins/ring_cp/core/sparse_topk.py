"""Layer: ring_cp core (plain torch, no SGLang import). Sparse top-k attention (DSA-style) under CP.

Each query attends only to the keys a light indexer selected for it (`topk_idx`, global token
ids of the packed batch, -1 = unused slot), over an MLA-style shared latent K/V (T, 1, D),
v = latent[..., :v_dim]. The indexer itself is outside this module: both paths take the same
indices.

- All-gather path: gather the whole latent (SGLang's zigzag semantics), then attend each query
  to its rows of it.
- Ring path: split each query's selections once by the group that holds the key (group 0: this
  rank's own shard, read in place; then one group per remote chunk, in arrival order). Attend
  to the own group while the first chunk is in flight, then to each arriving chunk's
  selections, and merge by LSE.

Kernels: "triton" (CUDA, or CPU under TRITON_INTERPRET=1; `kernels/sparse_lse.py`): a
counting-sort bucketing kernel and a gather attention kernel that handles all heads of a
query per program and merges in place. "torch": the reference, with dense padded gathers per
block of `q_chunk` queries.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from kllm_plugins.plugins.ring_cp.core.allgather_attention import GatherStats, gather_full_kv
from kllm_plugins.plugins.ring_cp.core.block_attn import default_scale
from kllm_plugins.plugins.ring_cp.core.lse_merge import PartialAttention
from kllm_plugins.plugins.ring_cp.core.ring_attention import RingStats, run_ring
from kllm_plugins.plugins.ring_cp.core.ring_comm import RingExchanger
from kllm_plugins.plugins.ring_cp.core.shape_checks import check_chunks, check_group, check_sparse_inputs
from kllm_plugins.plugins.ring_cp.core.shard_plan import ShardPlan

SPARSE_KERNELS = ("torch", "triton")


def select_sparse_kernel(name: str = "auto", device_type: str | None = None) -> str:
    """"auto": triton on CUDA, torch elsewhere; "triton" on CPU needs TRITON_INTERPRET=1."""
    from kllm_plugins.hardware import get_adapter

    adapter = get_adapter(device_type) if device_type else get_adapter()
    if name == "auto":
        return "triton" if adapter.device_type == "cuda" and adapter.kernels().get("triton", False) else "torch"
    if name not in SPARSE_KERNELS:
        raise ValueError(f"sparse kernel must be one of auto, {', '.join(SPARSE_KERNELS)}; got {name!r}")
    if name == "triton":
        kernels = adapter.kernels()
        ok = kernels.get("triton", False) or (
            kernels.get("triton_interpret", False) and os.environ.get("TRITON_INTERPRET") == "1"
        )
        if not ok:
            raise ValueError(f"sparse kernel 'triton' is not available on the {adapter.name} adapter")
    return name


def sparse_gather_attention(
    q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, scale: float, v_dim: int, q_chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: q (Sq, H, D) against rows idx (Sq, m) of latent (Sk, 1, D); -1 entries are skipped."""
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
    stats: GatherStats | None = None, q_chunk: int = 1024, kernel: str = "torch",
    full_latent: torch.Tensor | None = None, kernel_config: int | None = None, key_blocks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-gather baseline; `full_latent` skips the gather (compute-only timing).

    `key_blocks` > 1 (triton) walks the full latent in that many position blocks, one launch
    each, merged in place: the same cache locality the ring's per-chunk launches get, offered to
    the baseline too, so a ring win cannot come from locality alone.
    """
    if full_latent is None:
        check_sparse_inputs(q, latent, topk_idx, plan, rank, v_dim)
    else:
        check_sparse_inputs(q, full_latent, topk_idx, plan, rank, v_dim, tokens=plan.total)
    scale = scale if scale is not None else default_scale(q.shape[-1])
    v_dim = v_dim or latent.shape[-1]
    if full_latent is None:
        full_latent = gather_full_kv([latent], plan, rank, group, stats if stats is not None else GatherStats())[0]
    if kernel == "triton":
        from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import sparse_latent_attention

        if key_blocks <= 1:
            out, lse = sparse_latent_attention(q, full_latent, topk_idx, scale=scale, v_dim=v_dim,
                                               config=kernel_config)
        else:
            from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import bucket_topk

            total = full_latent.shape[0]
            ids = torch.arange(total, dtype=torch.int32, device=q.device)
            size = -(-total // key_blocks)
            rows, starts = bucket_topk(topk_idx, ids // size, ids, key_blocks)
            out, lse = sparse_latent_attention(q, full_latent, rows, scale=scale, v_dim=v_dim, starts=starts,
                                               group=0, config=kernel_config)
            for g in range(1, key_blocks):
                sparse_latent_attention(q, full_latent, rows, scale=scale, v_dim=v_dim, starts=starts, group=g,
                                        acc_out=out, acc_lse=lse, config=kernel_config)
    else:
        out, lse = sparse_gather_attention(q, full_latent, topk_idx, scale, v_dim, q_chunk)
    return out.to(q.dtype), lse


@dataclass
class GroupTables:
    """Where each global key lives from one rank's view: its group and its row in that group's buffer.

    Group 0 is the rank's own shard (rows = local offsets); group 1 + j * C + c is chunk c of
    the j-th remote shard in ring arrival order (source rank - 1 - j), rows = offsets in the
    packed chunk buffer.
    """

    group_of: torch.Tensor
    local_of: torch.Tensor
    ngroups: int

    @staticmethod
    def build(plan: ShardPlan, rank: int, chunks_per_shard: int, device: torch.device) -> GroupTables:
        group_of = torch.full((plan.total,), -1, dtype=torch.int32, device=device)
        local_of = torch.zeros((plan.total,), dtype=torch.int32, device=device)
        own = plan.global_index(rank, device)
        group_of[own] = 0
        local_of[own] = torch.arange(own.numel(), dtype=torch.int32, device=device)
        for j in range(plan.world - 1):
            src = (rank - 1 - j) % plan.world
            gidx = plan.global_index(src, device)
            for c, pcs in enumerate(plan.chunk_pieces(src, chunks_per_shard)):
                off = 0
                for lo, hi in pcs:
                    group_of[gidx[lo:hi]] = 1 + j * chunks_per_shard + c
                    local_of[gidx[lo:hi]] = torch.arange(off, off + hi - lo, dtype=torch.int32, device=device)
                    off += hi - lo
        return GroupTables(group_of, local_of, 1 + (plan.world - 1) * chunks_per_shard)

    def group(self, rank: int, src: int, c: int, world: int, chunks_per_shard: int) -> int:
        if src == rank:
            return 0
        return 1 + ((rank - 1 - src) % world) * chunks_per_shard + c


def bucket_topk_torch(
    idx: torch.Tensor, group_of: torch.Tensor, local_of: torch.Tensor, ngroups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `kernels.sparse_lse.bucket_topk` (same contract), with a stable sort."""
    valid = idx >= 0
    safe = idx.clamp(min=0).long()
    grp = torch.where(valid, group_of[safe], torch.full_like(group_of[safe], ngroups)).long()
    order = torch.sort(grp, dim=1, stable=True).indices
    rows = torch.gather(torch.where(valid, local_of[safe], -1), 1, order).to(torch.int32)
    counts = torch.zeros(idx.shape[0], ngroups + 1, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(1, grp, torch.ones_like(grp, dtype=torch.int32))
    starts = torch.zeros(idx.shape[0], ngroups + 1, dtype=torch.int32, device=idx.device)
    starts[:, 1:] = torch.cumsum(counts[:, :ngroups], dim=1)
    return rows, starts


class _TorchGroups:
    """Padded per-block views of one group's selections for the torch reference path."""

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor, ngroups: int, q_chunk: int) -> None:
        self.rows, self.starts, self.q_chunk = rows, starts, q_chunk
        counts = (starts[:, 1:] - starts[:, :-1])
        nq = rows.shape[0]
        nblk = -(-nq // q_chunk)
        padded = torch.zeros(nblk * q_chunk, ngroups, dtype=torch.int32, device=rows.device)
        padded[:nq] = counts
        self.counts = counts
        self.block_max: list[list[int]] = padded.view(nblk, q_chunk, ngroups).amax(1).tolist() if nq else []

    def for_group(self, g: int, lo: int, hi: int, m: int) -> torch.Tensor:
        ar = torch.arange(m, device=self.rows.device, dtype=torch.int32)
        pos = self.starts[lo:hi, g : g + 1] + ar
        ok = ar < self.counts[lo:hi, g : g + 1]
        vals = torch.gather(self.rows[lo:hi], 1, pos.clamp(max=max(self.rows.shape[1] - 1, 0)).long())
        return torch.where(ok, vals, torch.full_like(vals, -1))


def ring_sparse_attention(
    q: torch.Tensor, latent: torch.Tensor, topk_idx: torch.Tensor, plan: ShardPlan, rank: int, *,
    group: Any | None = None, scale: float | None = None, v_dim: int | None = None,
    chunks_per_shard: int = 1, comm: bool = True, stats: RingStats | None = None, q_chunk: int = 1024,
    kernel: str = "torch", kernel_config: int | None = None, tables: GroupTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring counterpart of `allgather_sparse_attention` (same result); `tables` may be cached per plan."""
    check_chunks(chunks_per_shard)
    check_sparse_inputs(q, latent, topk_idx, plan, rank, v_dim)
    scale = scale if scale is not None else default_scale(q.shape[-1])
    v_dim = v_dim or latent.shape[-1]
    stats = stats if stats is not None else RingStats()
    world = plan.world
    tables = tables or GroupTables.build(plan, rank, chunks_per_shard, q.device)
    if kernel == "triton":
        from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import bucket_topk, sparse_latent_attention

        rows, starts = bucket_topk(topk_idx, tables.group_of, tables.local_of, tables.ngroups)
        state: list[torch.Tensor] = []

        def attend(block: torch.Tensor, g: int) -> None:
            if not state:
                state.extend(sparse_latent_attention(q, block, rows, scale=scale, v_dim=v_dim, starts=starts,
                                                     group=g, config=kernel_config))
            else:
                sparse_latent_attention(q, block, rows, scale=scale, v_dim=v_dim, starts=starts, group=g,
                                        acc_out=state[0], acc_lse=state[1], config=kernel_config)
    else:
        rows, starts = bucket_topk_torch(topk_idx, tables.group_of, tables.local_of, tables.ngroups)
        groups = _TorchGroups(rows, starts, tables.ngroups, q_chunk)
        acc = PartialAttention(q.shape[0], q.shape[1], v_dim, q.device)

        def attend(block: torch.Tensor, g: int) -> None:
            for b, lo in enumerate(range(0, q.shape[0], q_chunk)):
                m = groups.block_max[b][g]
                if m == 0:
                    continue
                hi = min(q.shape[0], lo + q_chunk)
                o, l = sparse_gather_attention(q[lo:hi], block, groups.for_group(g, lo, hi, m), scale, v_dim, q_chunk)
                acc.merge(lo, hi, o, l)

    def compute_own() -> None:
        attend(latent, 0)

    def compute_remote(tensors: Any, src: int, c: int) -> None:
        attend(tensors[0], tables.group(rank, src, c, world, chunks_per_shard))

    if comm and world > 1:
        check_group(plan, group)
    exchanger = RingExchanger(group) if comm and world > 1 else None
    run_ring([latent], plan, rank, chunks_per_shard, compute_own, compute_remote, exchanger, stats)
    if kernel == "triton":
        return state[0].to(q.dtype), state[1]
    return acc.result(q.dtype)
