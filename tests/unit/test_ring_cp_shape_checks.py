"""ring_cp: bad shapes fail at the entry points with one line naming the cause, never deep inside."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kllm_plugins.plugins.ring_cp.core import ShardPlan, allgather_attention, ring_attention
from kllm_plugins.plugins.ring_cp.core.shape_checks import RingShapeError
from kllm_plugins.plugins.ring_cp.core.sparse_topk import allgather_sparse_attention, ring_sparse_attention


def _dense(plan: ShardPlan, rank: int, h: int, hkv: int, d: int = 8, dv: int | None = None,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[torch.Tensor]]:
    n = plan.local_len(rank)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, h, d, generator=g, dtype=dtype)
    return q, [torch.randn(n, hkv, d, generator=g, dtype=dtype), torch.randn(n, hkv, dv or d, generator=g, dtype=dtype)]


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ring_cp: "), msg
    return msg


# The case a user hit: 14 query heads over 4 KV heads, world sizes 3 and 5, uneven lengths.
@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
@pytest.mark.parametrize("entry", ["ring", "ring_chunked", "allgather"])
def test_heads_not_a_multiple_of_kv_heads(world: int, mode: str, entry: str) -> None:
    plan = ShardPlan.build([997, 1003], world, mode)  # type: ignore[arg-type]
    rank = world - 1
    q, kv = _dense(plan, rank, h=14, hkv=4)
    call: dict[str, Callable[[], Any]] = {
        "ring": lambda: ring_attention(q, kv, plan, rank),
        "ring_chunked": lambda: ring_attention(q, kv, plan, rank, chunks_per_shard=4),
        "allgather": lambda: allgather_attention(q, kv, plan, rank),
    }
    with pytest.raises(RingShapeError) as err:
        call[entry]()
    msg = _one_line(err)
    assert "14 query heads" in msg and "4 KV heads" in msg


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda q, kv: (q[:-1], kv), "q has"),
        (lambda q, kv: (q, [kv[0][:-2], kv[1]]), "k has"),
        (lambda q, kv: (q, [kv[0], kv[1][:, :1]]), "but v has 1"),
        (lambda q, kv: (q, [kv[0][..., :4], kv[1]]), "head_dim 4 differs"),
        (lambda q, kv: (q.unsqueeze(0), kv), "q must be 3-D"),
        (lambda q, kv: (q, [kv[0]]), "takes (k, v)"),
        (lambda q, kv: (q, [kv[0].to(torch.bfloat16), kv[1]]), "k is torch.bfloat16"),
        (lambda q, kv: (q.long(), kv), "floating-point"),
    ],
    ids=["q_tokens", "k_tokens", "v_heads", "k_head_dim", "q_ndim", "payload_len", "dtype", "int_q"],
)
def test_dense_shape_errors_name_the_quantity(mutate: Callable[..., Any], expect: str) -> None:
    plan = ShardPlan.build([40, 13], 2)
    q, kv = _dense(plan, 0, h=8, hkv=2)
    q2, kv2 = mutate(q, kv)
    for fn in (lambda: ring_attention(q2, kv2, plan, 0, comm=False), lambda: allgather_attention(q2, kv2, plan, 0)):
        with pytest.raises(RingShapeError) as err:
            fn()
        assert expect in _one_line(err)


def test_plan_and_rank_errors() -> None:
    plan = ShardPlan.build([40], 4)
    q, kv = _dense(plan, 1, h=4, hkv=2)
    with pytest.raises(RingShapeError, match="rank 4 is outside"):
        ring_attention(q, kv, plan, 4, comm=False)
    with pytest.raises(RingShapeError, match="chunks_per_shard must be an int >= 1"):
        ring_attention(q, kv, plan, 1, chunks_per_shard=0)
    with pytest.raises(RingShapeError, match="layout must be"):
        ring_attention(q, kv, plan, 1, layout="mla", comm=False)  # type: ignore[arg-type]
    # A multi-rank plan with communication but no process group: named, not a hang or a gloo error.
    with pytest.raises(RingShapeError, match="torch.distributed is not initialized"):
        ring_attention(q, kv, plan, 1)
    with pytest.raises(ValueError, match="at least one sequence"):
        ShardPlan.build([], 2)


def test_latent_and_sparse_errors() -> None:
    plan = ShardPlan.build([41, 19], 2)
    n = plan.local_len(1)
    q = torch.randn(n, 4, 16)
    lat = torch.randn(n, 1, 16)
    with pytest.raises(RingShapeError, match="one shared head"):
        ring_attention(q, [torch.randn(n, 2, 16)], plan, 1, layout="latent", comm=False)
    with pytest.raises(RingShapeError, match=r"v_dim=20 must be in 1\.\.16"):
        ring_attention(q, [lat], plan, 1, layout="latent", v_dim=20, comm=False)
    idx = torch.zeros(n, 5, dtype=torch.long)
    with pytest.raises(RingShapeError, match="topk_idx must be"):
        ring_sparse_attention(q, lat, idx[:-1], plan, 1, comm=False)
    with pytest.raises(RingShapeError, match="integer token ids"):
        allgather_sparse_attention(q, lat, idx.float(), plan, 1, full_latent=torch.randn(plan.total, 1, 16))
    with pytest.raises(RingShapeError, match="latent has"):
        allgather_sparse_attention(q, lat, idx, plan, 1, full_latent=lat)


def test_valid_inputs_still_compute() -> None:
    """The checks accept what the schedules accept: world 1 equals plain causal attention."""
    plan = ShardPlan.build([23, 9], 1)
    q, kv = _dense(plan, 0, h=6, hkv=3)
    out, lse = ring_attention(q, kv, plan, 0, chunks_per_shard=2)
    gout, glse = allgather_attention(q, kv, plan, 0)
    assert out.shape == (32, 6, 8) and lse.shape == (32, 6)
    torch.testing.assert_close(out, gout, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, glse, atol=1e-5, rtol=1e-5)
