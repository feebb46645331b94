"""Layer: ring_cp core (plain torch, no SGLang import). Ring attention, its all-gather baseline, shard plans."""
from __future__ import annotations

from kllm_plugins.plugins.ring_cp.core.allgather_attention import GatherStats, allgather_attention, gather_full_kv
from kllm_plugins.plugins.ring_cp.core.block_attn import select_block_attention, torch_block_attention
from kllm_plugins.plugins.ring_cp.core.lse_merge import PartialAttention, merge_into
from kllm_plugins.plugins.ring_cp.core.ring_attention import RingStats, ring_attention
from kllm_plugins.plugins.ring_cp.core.shard_plan import Segment, ShardPlan

__all__ = [
    "GatherStats", "PartialAttention", "RingStats", "Segment", "ShardPlan", "allgather_attention",
    "gather_full_kv", "merge_into", "ring_attention", "select_block_attention", "torch_block_attention",
]
