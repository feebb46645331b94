"""Layer: plugin core (torch only, no SGLang import). Building blocks of the trainable drafters.

Module and parameter names follow SGLang 0.5.23's DFlash/DSpark draft model
(`srt/models/dflash.py`) so a state dict saved from these modules loads there unchanged:
`layers.N.input_layernorm`, `layers.N.self_attn.{q,k,v,o}_proj`, `layers.N.self_attn.{q,k}_norm`
(Qwen3-style per-head norms), `layers.N.post_attention_layernorm`,
`layers.N.mlp.{gate,up,down}_proj`, `norm`, `fc`, `hidden_norm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kllm_plugins.plugins.dspark.core.target_llama import apply_rope, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,H,Q,D], k/v [B,Hkv,K,D], mask [B,Q,K] or [Q,K] bool (True = visible)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is not None:
        mask = mask.unsqueeze(1) if mask.dim() == 3 else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DraftAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, rope_theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of x [B,T,H] at positions [B,T]: [B,Hkv,T,D] each."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def q(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), cos, sin)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention takes extra (context) keys from outside."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 rope_theta: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DraftAttention(hidden, heads, kv_heads, head_dim, eps, rope_theta)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = DraftMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, extra_k: torch.Tensor | None,
                extra_v: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,T,H]. Keys = [extra ; own]; mask covers [extra ; own]. Returns (x, own k, own v)."""
        h = self.input_layernorm(x)
        q = self.self_attn.q(h, positions)
        k, v = self.self_attn.kv(h, positions)
        if extra_k is not None:
            k_all, v_all = torch.cat([extra_k, k], dim=2), torch.cat([extra_v, v], dim=2)
        else:
            k_all, v_all = k, v
        x = x + self.self_attn.out(gqa_attention(q, k_all, v_all, mask))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v
