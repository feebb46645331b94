"""Layer: ring_cp core (plain torch, no SGLang import). SGLang's zigzag local token order vs ours.

SGLang 0.5.23's `ZigzagCPStrategy` lays a rank's tokens out as all sequences' early blocks,
then all sequences' late blocks; `ShardPlan` (zigzag) is sequence-major. Both use the same
block sizes, so one permutation converts between them.
"""
from __future__ import annotations

import torch

from kllm_plugins.plugins.ring_cp.core.shard_plan import ShardPlan, block_sizes


def sglang_zigzag_order(seq_lens: list[int], world: int, rank: int) -> torch.Tensor:
    """Packed-batch token index of each local token, in SGLang's zigzag local order."""
    nblocks = 2 * world
    prev, nxt = [], []
    base = 0
    for n in seq_lens:
        sizes = block_sizes(n, nblocks)
        starts = [sum(sizes[:b]) for b in range(nblocks)]
        for out, b in ((prev, rank), (nxt, nblocks - 1 - rank)):
            out.append(torch.arange(base + starts[b], base + starts[b] + sizes[b], dtype=torch.long))
        base += n
    parts = prev + nxt
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def sglang_to_plan(seq_lens: list[int], world: int, rank: int) -> torch.Tensor:
    """perm such that x_plan = x_sglang[perm] for rank's local tokens (and x_sglang[perm] = x_plan inverts it)."""
    plan = ShardPlan.build(seq_lens, world, "zigzag")
    sg = sglang_zigzag_order(seq_lens, world, rank)
    pos_in_sg = torch.empty(plan.total, dtype=torch.long)
    pos_in_sg[sg] = torch.arange(sg.numel())
    return pos_in_sg[plan.global_index(rank)]
