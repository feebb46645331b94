"""Layer: hardware, CPU platform (plain torch, no SGLang import). Prefix-aware extend attention.

SGLang's torch-native attention backend computes an extend (prefill) batch one sequence at a
time by padding the new tokens' queries to the whole sequence and running causal attention over
the full square: a request whose first 512 tokens are cached still pays attention for all
576 x 576 query-key pairs, as if nothing were cached (measured: 40% of the scheduler's samples on
an L3 hit of 512 tokens + 64 new ones, `benchmarks/kv_tiers/breakeven.py` with py-spy). GPU
backends compute only the new tokens' rows. This does the same on CPU: the `n_new` queries
attend to all `prefix + n_new` keys under a causal mask shifted by the prefix, which gives the
same rows the padded square gives for them. Sequences without a prefix keep the square causal
call; cross attention, encoder lengths, sliding windows and non-causal calls go to the original.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.functional import scaled_dot_product_attention


def shifted_causal_mask(n_new: int, n_kv: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n_new, n_kv] booleans, True where new token i (at position n_kv - n_new + i) may attend key j."""
    return torch.ones(n_new, n_kv, dtype=torch.bool, device=device).tril(diagonal=n_kv - n_new)


def extend_attention(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     extend_seq_lens: torch.Tensor, scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    """Causal extend attention of a batch: query/output [tokens, heads, dim] (new tokens of every
    sequence, concatenated), caches [slots, kv_heads, dim]; the keys of sequence i are the slots
    `req_to_token[req_pool_indices[i], :seq_lens[i]]`, its last `extend_seq_lens[i]` positions new."""
    start = 0
    for i in range(seq_lens.shape[0]):
        n_new, n_kv = int(extend_seq_lens[i]), int(seq_lens[i])
        q = query[start:start + n_new].movedim(0, 1)  # [heads, n_new, dim]
        slots = req_to_token[req_pool_indices[i], :n_kv]
        k = k_cache[slots].movedim(0, 1)
        v = v_cache[slots].movedim(0, 1)
        if not (q.dtype == k.dtype == v.dtype):
            k, v = k.to(q.dtype), v.to(q.dtype)
        square = n_new == n_kv
        out = scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=None if square else shifted_causal_mask(n_new, n_kv, q.device),
            is_causal=square, scale=scaling, enable_gqa=enable_gqa)
        output[start:start + n_new] = out.squeeze(0).movedim(1, 0)
        start += n_new
    return output


def around_sdpa_forward_extend(original: Callable[..., Any], self: Any, query: torch.Tensor, output: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                               encoder_lens: torch.Tensor | None = None, scaling: float | None = None,
                               enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                               sliding_window_size: int | None = None) -> Any:
    """`TorchNativeAttnBackend._run_sdpa_forward_extend` for plain causal self-attention."""
    plain = causal and not is_cross_attn and encoder_lens is None and (
        sliding_window_size is None or sliding_window_size <= -1) and query.dim() == 3
    if not plain:
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_seq_lens, scaling, enable_gqa)
