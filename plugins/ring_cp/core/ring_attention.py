"""Layer: ring_cp core (plain torch, no SGLang import). Ring attention for context-parallel prefill.

Each rank keeps its query shard and its own K/V shard. K/V travel the ring in chunks (a shard
is cut into `chunks_per_shard` chunks, each the c-th slice of every segment so every step
carries a proportional share of the causal work) on a chunk-interleaved schedule: at step t, with
c, h = divmod(t, N - 1), rank r sends chunk c of shard r - h to rank r + 1 and receives chunk
c of shard r - 1 - h from rank r - 1. A chunk is computed on in the step after it arrives and
forwarded in that same step, so a rank holds its own shard plus two chunk buffers (the one in
compute/forward and the one in flight): about 1/N of the sequence plus two chunks, instead of
the whole sequence. Each chunk's block attention runs while the next chunk is in flight, and
the partial (out, lse) results merge exactly (lse_merge.py). Inference only: no backward.

K/V payloads:
- "kv":     (k, v), k (T, Hkv, D), v (T, Hkv, Dv); grouped-query attention when H > Hkv;
- "latent": (c,), c (T, 1, Dk), the MLA-style shared latent: k = c, v = c[..., :v_dim]; only
            the latent travels, so the ring moves one tensor per token instead of two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from kllm_plugins.plugins.ring_cp.core.block_attn import BlockAttention, default_scale, torch_block_attention
from kllm_plugins.plugins.ring_cp.core.lse_merge import PartialAttention
from kllm_plugins.plugins.ring_cp.core.ring_comm import RingExchanger
from kllm_plugins.plugins.ring_cp.core.shape_checks import check_chunks, check_dense_inputs, check_group
from kllm_plugins.plugins.ring_cp.core.shard_plan import Segment, ShardPlan

KVLayout = Literal["kv", "latent"]
# (q_lo, q_hi, k_lo, k_hi, causal) in local offsets of the query shard and the key chunk.
WorkItem = tuple[int, int, int, int, bool]


@dataclass
class RingStats:
    steps: int = 0
    bytes_sent: int = 0
    buffer_bytes: int = 0
    """Bytes of the two in-flight chunk buffers."""
    local_kv_bytes: int = 0
    items: int = 0
    per_step_items: list[int] = field(default_factory=list)

    @property
    def peak_kv_bytes(self) -> int:
        return self.local_kv_bytes + self.buffer_bytes


def kv_views(payload: Sequence[torch.Tensor], layout: KVLayout, v_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "kv":
        return payload[0], payload[1]
    latent = payload[0]
    return latent, latent[..., : (v_dim if v_dim is not None else latent.shape[-1])]


def own_items(plan: ShardPlan, rank: int, causal: bool) -> list[WorkItem]:
    """Work of a shard against itself: per sequence, one call over its local segments.

    A sequence's local segments are disjoint and in increasing position order, so the plain
    causal mask over their concatenation is the exact global causal mask.
    """
    items: list[WorkItem] = []
    by_seq: dict[int, list[Segment]] = {}
    for s in plan.segments[rank]:
        by_seq.setdefault(s.seq, []).append(s)
    for segs in by_seq.values():
        lo, hi = segs[0].local, segs[-1].local + segs[-1].length
        items.append((lo, hi, lo, hi, causal))
    return items


def remote_items(q_segs: Sequence[Segment], k_segs: Sequence[Segment], causal: bool) -> list[WorkItem]:
    """Work of a query shard against a key chunk of another rank (all blocks fully visible or not)."""
    raw: list[tuple[int, int, int, int]] = []
    for q in q_segs:
        vis = []
        for k in k_segs:
            if k.seq != q.seq:
                continue
            if causal:
                if k.start < q.end and q.start < k.end:
                    raise ValueError(f"key segment {k} overlaps query segment {q} across ranks")
                if k.start >= q.end:
                    continue
            vis.append(k)
        vis.sort(key=lambda s: s.local)
        runs: list[list[int]] = []
        for k in vis:
            if runs and runs[-1][1] == k.local:
                runs[-1][1] = k.local + k.length
            else:
                runs.append([k.local, k.local + k.length])
        raw.extend((q.local, q.local + q.length, a, b) for a, b in runs)
    # Join query ranges that are adjacent and see the same key run (one call instead of two).
    raw.sort(key=lambda it: (it[2], it[3], it[0]))
    items: list[WorkItem] = []
    for qlo, qhi, klo, khi in raw:
        if items and items[-1][2:4] == (klo, khi) and items[-1][1] == qlo:
            items[-1] = (items[-1][0], qhi, klo, khi, False)
        else:
            items.append((qlo, qhi, klo, khi, False))
    return items


def run_items(
    acc: PartialAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: Sequence[WorkItem],
    attn: BlockAttention, scale: float,
) -> None:
    """Run block attention for each work item and fold it into `acc` (in-kernel when the kernel can)."""
    fused = getattr(attn, "accumulates", False)
    for qlo, qhi, klo, khi, causal in items:
        if fused:
            attn(q[qlo:qhi], k[klo:khi], v[klo:khi], causal, scale,  # type: ignore[call-arg]
                 acc_out=acc.out[qlo:qhi], acc_lse=acc.lse[qlo:qhi])
            continue
        out, lse = attn(q[qlo:qhi], k[klo:khi], v[klo:khi], causal, scale)
        acc.merge(qlo, qhi, out, lse)


RemoteCompute = Callable[[Sequence[torch.Tensor], int, int], None]


def run_ring(
    payload: Sequence[torch.Tensor], plan: ShardPlan, rank: int, chunks_per_shard: int,
    compute_own: Callable[[], None], compute_remote: RemoteCompute,
    exchanger: RingExchanger | None, stats: RingStats,
) -> None:
    """Drive the chunk-interleaved ring; `exchanger=None` runs the same compute with no transfers."""
    world, nch = plan.world, chunks_per_shard
    pieces = [plan.chunk_pieces(s, nch) for s in range(world)]
    lens = [[sum(hi - lo for lo, hi in pc) for pc in pieces[s]] for s in range(world)]
    max_chunk = max(n for ls in lens for n in ls) if world > 1 else 0
    bufs = [[p.new_zeros((max_chunk, *p.shape[1:])) for p in payload] for _ in range(2)]
    if exchanger is None:
        # Compute-only timing: fill the buffers with real data once so the kernels see finite values.
        for b in bufs:
            for t, p in zip(b, payload):
                n = min(max_chunk, p.shape[0])
                t[:n].copy_(p[:n])
    stats.buffer_bytes = sum(t.numel() * t.element_size() for b in bufs for t in b) if world > 1 else 0
    stats.local_kv_bytes = sum(p.numel() * p.element_size() for p in payload)

    def own_views(c: int) -> list[torch.Tensor]:
        return [p[lo:hi] for lo, hi in pieces[rank][c] for p in payload]

    def buffer_views(b: list[torch.Tensor], src: int, c: int) -> list[torch.Tensor]:
        # The same piece boundaries as the sender's, packed back to back.
        out, off = [], 0
        for lo, hi in pieces[src][c]:
            out.extend(t[off : off + hi - lo] for t in b)
            off += hi - lo
        return out

    steps = (world - 1) * nch
    prev: tuple[list[torch.Tensor], int, int] | None = None
    prev_buf: list[torch.Tensor] = []
    cur = 0
    for t in range(steps):
        c, h = divmod(t, world - 1)
        if h == 0:
            send = own_views(c)
        else:
            assert prev is not None and prev[1] == (rank - h) % world and prev[2] == c
            send = buffer_views(prev_buf, prev[1], c)
        src = (rank - 1 - h) % world
        n = lens[src][c]
        recv_buf = [b[:n] for b in bufs[cur]]
        if exchanger is not None:
            exchanger.start(send, buffer_views(recv_buf, src, c))
        if prev is None:
            compute_own()
        else:
            compute_remote(*prev)
        if exchanger is not None:
            exchanger.wait()
        prev, prev_buf = (recv_buf, src, c), recv_buf
        cur ^= 1
        stats.steps += 1
    if prev is None:
        compute_own()
    else:
        compute_remote(*prev)
    if exchanger is not None:
        stats.bytes_sent = exchanger.bytes_sent


def ring_attention(
    q: torch.Tensor, payload: Sequence[torch.Tensor], plan: ShardPlan, rank: int, *,
    group: Any | None = None, causal: bool = True, scale: float | None = None,
    attn: BlockAttention | None = None, layout: KVLayout = "kv", v_dim: int | None = None,
    chunks_per_shard: int = 1, comm: bool = True, stats: RingStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's query shard against the whole (sharded) K/V of `plan`.

    q: (T_local, H, Dk) in the plan's local layout for `rank`; payload: this rank's K/V shard.
    Returns out (T_local, H, Dv) in q's dtype and lse (T_local, H) in fp32.
    `comm=False` runs the identical compute schedule without transfers (for timing).
    """
    check_chunks(chunks_per_shard)
    check_dense_inputs(q, payload, plan, rank, layout, v_dim)
    attn = attn or torch_block_attention
    scale = scale if scale is not None else default_scale(q.shape[-1])
    stats = stats if stats is not None else RingStats()
    k_loc, v_loc = kv_views(payload, layout, v_dim)
    acc = PartialAttention(q.shape[0], q.shape[1], v_loc.shape[-1], q.device)
    q_segs = plan.segments[rank]
    remote_cache: dict[tuple[int, int], list[WorkItem]] = {}

    def compute_own() -> None:
        items = own_items(plan, rank, causal)
        stats.items += len(items)
        run_items(acc, q, k_loc, v_loc, items, attn, scale)

    def compute_remote(tensors: Sequence[torch.Tensor], src: int, c: int) -> None:
        key = (src, c)
        if key not in remote_cache:
            remote_cache[key] = remote_items(q_segs, plan.chunk_segments(src, chunks_per_shard, c), causal)
        items = remote_cache[key]
        stats.items += len(items)
        stats.per_step_items.append(len(items))
        k, v = kv_views(tensors, layout, v_dim)
        run_items(acc, q, k, v, items, attn, scale)

    if comm and plan.world > 1:
        check_group(plan, group)
    exchanger = RingExchanger(group) if comm and plan.world > 1 else None
    run_ring(payload, plan, rank, chunks_per_shard, compute_own, compute_remote, exchanger, stats)
    return acc.result(q.dtype)
