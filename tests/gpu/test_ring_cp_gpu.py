"""ring_cp on GPUs: the Triton kernel and the NCCL ring against torch SDPA (skipped without CUDA)."""
from __future__ import annotations

import math
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_kernels_match_sdpa(causal: bool) -> None:
    from kllm_plugins.plugins.ring_cp.core.block_attn import select_block_attention, torch_block_attention

    torch.manual_seed(0)
    for sq, sk, h, hkv, d in ((1000, 1000, 32, 8, 128), (517, 2048, 16, 2, 64), (4096, 4096, 8, 8, 128)):
        q = torch.randn(sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        scale = 1 / math.sqrt(d)
        ref_out, ref_lse = torch_block_attention(q, k, v, causal, scale)  # fp32 math
        mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq) if causal else None
        sdpa = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                              v.float().transpose(0, 1), attn_mask=mask, scale=scale,
                                              enable_gqa=True).transpose(0, 1)
        assert (ref_out - sdpa).abs().max().item() < 1e-3
        for name in ("sdpa_flash", "triton"):
            out, lse = select_block_attention(name)(q, k, v, causal, scale)
            assert (out - sdpa).abs().max().item() < 2e-2, name
            assert (lse - ref_lse).abs().max().item() < 2e-2, name


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_ring_over_nccl_matches_sdpa(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from ring_cp_gpu_cases import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = min(torch.cuda.device_count(), 4)
    try:
        mp.spawn(run, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    except Exception as exc:
        errs = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        raise AssertionError(errs or str(exc)) from exc


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(512, 512), (576, 512)])
def test_sparse_kernels_match_torch_reference(d: int, dv: int) -> None:
    from kllm_plugins.plugins.ring_cp.core.sparse_topk import bucket_topk_torch, sparse_gather_attention
    from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import bucket_topk, sparse_latent_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    sq, h, sk, topk, ngroups = 3000, 16, 20000, 2048, 5
    q = torch.randn(sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lat = torch.randn(sk, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randint(-1, sk, (sq, topk), device="cuda", dtype=torch.int32, generator=g)
    idx[:7] = -1
    scale = 1 / math.sqrt(d)
    ref_o, ref_l = sparse_gather_attention(q, lat, idx, scale, dv)
    out, lse = sparse_latent_attention(q, lat, idx, scale=scale, v_dim=dv)
    fin = torch.isfinite(ref_l)
    assert torch.equal(fin, torch.isfinite(lse)) and (~fin).sum().item() == 7 * h
    assert (out[fin] - ref_o[fin]).abs().max().item() < 2e-2
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 2e-2
    group_of = torch.randint(0, ngroups, (sk,), device="cuda", dtype=torch.int32, generator=g)
    local_of = torch.arange(sk, device="cuda", dtype=torch.int32)
    rows, starts = bucket_topk(idx, group_of, local_of, ngroups)
    rows_t, starts_t = bucket_topk_torch(idx, group_of, local_of, ngroups)
    assert torch.equal(starts, starts_t)
    ao, al = sparse_latent_attention(q, lat, rows, scale=scale, v_dim=dv, starts=starts, group=0)
    for grp in range(1, ngroups):
        sparse_latent_attention(q, lat, rows, scale=scale, v_dim=dv, starts=starts, group=grp, acc_out=ao, acc_lse=al)
    assert (ao[fin] - ref_o[fin]).abs().max().item() < 2e-2
    assert (al[fin] - ref_l[fin]).abs().max().item() < 2e-2
