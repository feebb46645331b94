"""Layer: plugin core (torch only, no SGLang import). A Llama target with a ragged KV cache.

The reference speculative loop needs three things a stock Hugging Face model does not give
together: a KV cache whose rows advance by different amounts (each request accepts its own
number of drafted tokens), the hidden states of chosen layers for the verified tokens, and
the same code on CPU and GPU. This module is a plain Llama forward over a Hugging Face state
dict (`model.layers.N...`); `tests/unit/test_dspark_target_llama.py` checks its logits against
transformers.

Hidden-state convention: `capture_layers=[l]` returns the output of decoder layer `l` (the
residual stream after it), which is what SGLang's `set_dflash_layers_to_capture([l])` captures
and what transformers calls `hidden_states[l + 1]`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger("kllm.dspark")


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "LlamaShape":
        rope = cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of neox-style (rotate-half) rotary embeddings, shape [..., head_dim]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class RaggedKVCache:
    """Per-layer K/V of shape [B, Hkv, S, D]; row b holds `lens[b]` committed tokens.

    A forward writes its T tokens at positions lens[b]..lens[b]+T-1 without moving `lens`;
    the caller commits what it keeps with `advance` (rejected drafts are then overwritten).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 *, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len

    def write_index(self, t: int) -> torch.Tensor:
        idx = self.lens.unsqueeze(1) + torch.arange(t, device=self.lens.device)
        if int(idx.max()) >= self.max_len:
            raise ValueError(f"KV cache overflow: need {int(idx.max()) + 1} > {self.max_len} positions")
        return idx

    def advance(self, n: torch.Tensor) -> None:
        self.lens = self.lens + n.to(self.lens)


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor,
                     t: int, extra_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T new queries (already written at lens..lens+T-1) over the cache.

    q: [B, H, T, D]; caches [B, Hkv, S, D]. Query i of row b sees keys j <= lens[b] + i.
    `extra_mask` ([B, T, S] bool, True = visible) replaces the causal rule when given.
    """
    b, h, _, d = q.shape
    s = k_cache.shape[2]
    if extra_mask is None:
        j = torch.arange(s, device=q.device)
        limit = lens.view(b, 1, 1) + torch.arange(t, device=q.device).view(1, t, 1)
        mask = j.view(1, 1, s) <= limit
    else:
        mask = extra_mask
    rep = h // k_cache.shape[1]
    k = k_cache.repeat_interleave(rep, dim=1) if rep > 1 else k_cache
    v = v_cache.repeat_interleave(rep, dim=1) if rep > 1 else v_cache
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))


class LlamaTarget:
    """Inference-only Llama over a Hugging Face state dict (no autograd, no transformers)."""

    def __init__(self, shape: LlamaShape, state: Mapping[str, torch.Tensor], *, device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype

        def get(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if shape.tie_word_embeddings or "lm_head.weight" not in state else get("lm_head.weight")
        self.final_norm = get("model.norm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": get(p + "input_layernorm.weight"),
                "ln2": get(p + "post_attention_layernorm.weight"),
                "qkv": torch.cat([get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                                  get(p + "self_attn.v_proj.weight")], dim=0),
                "o": get(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0),
                "down": get(p + "mlp.down_proj.weight"),
            })

    def new_cache(self, batch: int, max_len: int) -> RaggedKVCache:
        s = self.shape
        return RaggedKVCache(s.num_layers, batch, s.num_kv_heads, max_len, s.head_dim, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: RaggedKVCache, *, capture_layers: Sequence[int] = (),
                want_logits: bool = True, logits_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run T new tokens per row at positions cache.lens..; returns (logits [B,T,V] fp32, features).

        `logits_index` ([B] offsets into the T new tokens) computes the logits of one token per row
        only ([B,1,V]): a large prefill batch then never materialises [B,T,V].
        Features: the captured layers' outputs concatenated on the last dim, [B, T, K*hidden].
        The cache's `lens` is not advanced (see `RaggedKVCache.advance`).
        """
        s = self.shape
        bsz, t = tokens.shape
        idx = cache.write_index(t)
        cos, sin = rope_cos_sin(idx, s.head_dim, s.rope_theta, self.dtype)
        rows = torch.arange(bsz, device=self.device).unsqueeze(1)
        x = F.embedding(tokens, self.embed)
        captured: list[torch.Tensor] = []
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["ln1"], s.rms_norm_eps)
            q, k, v = (h @ w["qkv"].T).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(bsz, t, s.num_heads, s.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(bsz, t, s.num_kv_heads, s.head_dim).transpose(1, 2), cos, sin)
            v = v.view(bsz, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
            cache.k[i][rows, :, idx] = k.transpose(1, 2)
            cache.v[i][rows, :, idx] = v.transpose(1, 2)
            a = ragged_attention(q, cache.k[i], cache.v[i], cache.lens, t)
            x = x + a.transpose(1, 2).reshape(bsz, t, q_size) @ w["o"].T
            h = rms_norm(x, w["ln2"], s.rms_norm_eps)
            g, u = (h @ w["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ w["down"].T
            if i in capture_layers:
                captured.append(x)
        feats = torch.cat([captured[list(capture_layers).index(i)] for i in capture_layers], dim=-1) if capture_layers else None
        if not want_logits:
            return None, feats
        if logits_index is not None:
            x = x[torch.arange(bsz, device=self.device), logits_index.to(self.device)].unsqueeze(1)
        logits = (rms_norm(x, self.final_norm, s.rms_norm_eps) @ self.lm_head.T).float()
        return logits, feats

    @torch.no_grad()
    def full_forward(self, tokens: torch.Tensor, *, capture_layers: Sequence[int] = (),
                     want_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward over whole sequences from position 0 with a throwaway cache (training features)."""
        cache = self.new_cache(tokens.shape[0], tokens.shape[1])
        return self.forward(tokens, cache, capture_layers=capture_layers, want_logits=want_logits)


def default_target_layers(num_layers: int, count: int) -> list[int]:
    """Evenly spread layer ids from 1 to num_layers - 3 (DFlash/DeepSpec's depth range; up to
    num_layers - 2 for models under 8 layers: SGLang captures layer id's output as the input of
    layer id + 1, so the last layer's id is never captured there)."""
    if count <= 0:
        raise ValueError("count must be positive")
    lo, hi = 1, (num_layers - 3 if num_layers >= 8 else max(1, num_layers - 2))
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})
