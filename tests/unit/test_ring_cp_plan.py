"""ring_cp core without processes: shard plans, balanced chunks, LSE merge, work items, plugin config."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.plugins.ring_cp.core import ShardPlan, merge_into, torch_block_attention
from kllm_plugins.plugins.ring_cp.core.ring_attention import own_items, remote_items
from kllm_plugins.plugins.ring_cp.core.sglang_layout import sglang_to_plan, sglang_zigzag_order


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=4), st.integers(1, 5), st.sampled_from(["zigzag", "contiguous"]),
       st.integers(1, 5))
def test_plan_partitions_every_token_once(seq_lens: list[int], world: int, mode: str, nch: int) -> None:
    plan = ShardPlan.build(seq_lens, world, mode)  # type: ignore[arg-type]
    idx = torch.cat([plan.global_index(r) for r in range(world)])
    assert sorted(idx.tolist()) == list(range(sum(seq_lens)))
    x = torch.arange(plan.total * 3).reshape(plan.total, 3)
    assert torch.equal(plan.unshard([plan.shard(x, r) for r in range(world)]), x)
    for r in range(world):
        pieces = plan.chunk_pieces(r, nch)
        flat = sorted(p for pc in pieces for p in pc)
        covered = [i for lo, hi in flat for i in range(lo, hi)]
        assert covered == list(range(plan.local_len(r)))
        for c in range(nch):
            segs = plan.chunk_segments(r, nch, c)
            assert sum(s.length for s in segs) == plan.chunk_len(r, nch, c)


def test_zigzag_balances_causal_work_and_contiguous_does_not() -> None:
    z = ShardPlan.build([4096], 4, "zigzag")
    c = ShardPlan.build([4096], 4, "contiguous")
    zw = [z.causal_work(r) for r in range(4)]
    cw = [c.causal_work(r) for r in range(4)]
    assert sum(zw) == sum(cw) == 4096 * 4097 // 2
    assert max(zw) / (sum(zw) / 4) < 1.001
    assert max(cw) / (sum(cw) / 4) > 1.7


def test_balanced_chunks_give_equal_step_work() -> None:
    # Rank 1 receiving rank 0's chunks (zigzag, N=2): every chunk should carry the same visible work.
    plan = ShardPlan.build([4000], 2, "zigzag")
    works = []
    for c in range(4):
        items = remote_items(plan.segments[1], plan.chunk_segments(0, 4, c), causal=True)
        works.append(sum((qh - ql) * (kh - kl) for ql, qh, kl, kh, _ in items))
    assert max(works) - min(works) <= 0.01 * max(works)
    assert min(works) > 0


def test_remote_items_respect_causality_and_merge_calls() -> None:
    plan = ShardPlan.build([80], 2, "zigzag")  # rank0: [0,20) + [60,80); rank1: [20,40) + [40,60)
    items0 = remote_items(plan.segments[0], plan.segments[1], causal=True)
    assert items0 == [(20, 40, 0, 40, False)]  # only rank0's late block sees rank1, both of its blocks
    items1 = remote_items(plan.segments[1], plan.segments[0], causal=True)
    assert items1 == [(0, 40, 0, 20, False)]  # both of rank1's blocks see rank0's early block, in one call
    assert own_items(plan, 0, True) == [(0, 40, 0, 40, True)]


def test_merge_of_two_halves_equals_whole() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 5)
    whole_o, whole_l = torch_block_attention(q, k, v, False, 0.3)
    o, l = torch_block_attention(q, k[:11], v[:11], False, 0.3)
    o2, l2 = torch_block_attention(q, k[11:], v[11:], False, 0.3)
    merge_into(o, l, o2, l2)
    assert torch.allclose(o, whole_o, atol=1e-5) and torch.allclose(l, whole_l, atol=1e-5)
    # Merging an empty partial (lse = -inf) changes nothing and yields no NaN.
    merge_into(o, l, torch.zeros_like(o), torch.full_like(l, float("-inf")))
    assert torch.allclose(o, whole_o, atol=1e-5) and not torch.isnan(o).any()


def test_sglang_layout_permutation_roundtrip() -> None:
    seq_lens, world = [37, 12, 50], 3
    plan = ShardPlan.build(seq_lens, world, "zigzag")
    for r in range(world):
        sg = sglang_zigzag_order(seq_lens, world, r)
        perm = sglang_to_plan(seq_lens, world, r)
        assert torch.equal(sg[perm], plan.global_index(r))


def test_config_validation_names_the_field() -> None:
    from kllm_plugins.plugins.ring_cp.config import RingCPConfig

    with pytest.raises(ValueError, match="chunks_per_shard"):
        RingCPConfig(chunks_per_shard=0)
    with pytest.raises(ValueError, match="kernel"):
        RingCPConfig(kernel="cudnn")


def test_plugin_declares_and_builds_config_from_env() -> None:
    from kllm_plugins.errors import KllmConfigError
    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.plugins.ring_cp import hookimpls

    pm = KllmPluginManager(extra_plugins=[("ring_cp", hookimpls)], load_entry_points=False)
    assert "ring_cp" in pm.names()
    (ep,) = pm.build(["ring_cp"], environ={"KLLM_RING_CP_CHUNKS_PER_SHARD": "8", "KLLM_RING_CP_KERNEL": "triton"})
    assert ep.config.chunks_per_shard == 8 and ep.config.kernel == "triton"
    with pytest.raises(KllmConfigError, match="keep_full_kv_in_pool"):
        pm.build(["ring_cp"], environ={"KLLM_RING_CP_KEEP_FULL_KV_IN_POOL": "false"})
    with pytest.raises(KllmConfigError, match="chunks_per_shard"):
        pm.build(["ring_cp"], environ={"KLLM_RING_CP_CHUNKS_PER_SHARD": "0"})
