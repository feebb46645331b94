"""ring_cp: the Triton block-attention kernel under TRITON_INTERPRET=1 against torch SDPA (CPU, tiny shapes)."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from triton_interpret import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import math, torch
    import torch.nn.functional as F
    from kllm_plugins.plugins.ring_cp.core.block_attn import select_block_attention
    attn = select_block_attention("triton", "cpu")
    torch.manual_seed(0)
    # (sq, sk, h, hkv, d, dv, causal): odd sizes, GQA, bottom-right causal, dv != d
    cases = [(5, 5, 2, 2, 8, 8, True), (17, 33, 4, 2, 16, 16, True), (19, 19, 4, 1, 24, 24, False),
             (9, 40, 2, 1, 8, 12, True), (1, 7, 2, 2, 8, 8, False)]
    fused = 0
    for sq, sk, h, hkv, d, dv, causal in cases:
        q, k, v = torch.randn(sq, h, d), torch.randn(sk, hkv, d), torch.randn(sk, hkv, dv)
        scale = 1 / math.sqrt(d)
        out, lse = attn(q, k, v, causal, scale)
        qt = q.transpose(0, 1)
        kt = k.repeat_interleave(h // hkv, 1).transpose(0, 1)
        vt = v.repeat_interleave(h // hkv, 1).transpose(0, 1)
        mask = None
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(0, 1)
        s = (qt @ kt.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        ref_lse = torch.logsumexp(s, -1).transpose(0, 1)
        eo, el = (out - ref).abs().max().item(), (lse - ref_lse).abs().max().item()
        assert eo < 1e-4 and el < 1e-4, (sq, sk, h, hkv, d, dv, causal, eo, el)
        if sk >= 2 * sq and not causal:
            # Fused accumulation: two key halves merged in-kernel equal the whole.
            acc_o = torch.zeros(sq, h, dv)
            acc_l = torch.full((sq, h), float("-inf"))
            half = sk // 2
            attn(q, k[:half], v[:half], False, scale, acc_out=acc_o, acc_lse=acc_l)
            attn(q, k[half:], v[half:], False, scale, acc_out=acc_o, acc_lse=acc_l)
            assert (acc_o - ref).abs().max().item() < 1e-4 and (acc_l - ref_lse).abs().max().item() < 1e-4
            fused += 1
    assert fused == 1
    print("TRITON_OK", len(cases))
    """
)


def test_triton_block_attention_matches_sdpa_interpreted() -> None:
    assert "TRITON_OK 5" in run_interpreted(SCRIPT)
