"""The CPU platform's prefix-aware extend attention gives, for every new token, the row SGLang's
torch-native backend computes by padding the new queries to the full sequence (reference below),
with and without cached prefixes, GQA and mixed batches; non-plain calls go to the original."""
from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from kllm_plugins.hardware.cpu.extend_attention import around_sdpa_forward_extend, shifted_causal_mask


def padded_square_reference(query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix_lens,
                            extend_lens, scaling, enable_gqa):
    """What the torch-native backend does: new queries placed at their positions in a full-length
    query, causal attention over the square, the new rows kept."""
    out = torch.zeros_like(query)
    q_all = query.movedim(0, 1)
    start = 0
    for i in range(seq_lens.shape[0]):
        n_new, n_kv, pre = int(extend_lens[i]), int(seq_lens[i]), int(prefix_lens[i])
        padded = torch.zeros(q_all.shape[0], n_kv, q_all.shape[2], dtype=query.dtype)
        padded[:, pre:, :] = q_all[:, start:start + n_new, :]
        slots = req_to_token[req_pool_indices[i], :n_kv]
        k, v = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)
        full = scaled_dot_product_attention(padded.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                            scale=scaling, enable_gqa=enable_gqa).squeeze(0).movedim(1, 0)
        out[start:start + n_new] = full[pre:]
        start += n_new
    return out


def _batch(prefixes, news, heads, kv_heads, dim=8, slots=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = [p + n for p, n in zip(prefixes, news)]
    k_cache = torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g)
    req_to_token = torch.zeros(8, 128, dtype=torch.long)
    perm = torch.randperm(slots, generator=g)
    used = 0
    for i, n in enumerate(seq):  # scattered slots, as the allocator hands them out
        req_to_token[i + 2, :n] = perm[used:used + n]
        used += n
    query = torch.randn(sum(news), heads, dim, generator=g)
    return (query, k_cache, v_cache, req_to_token, torch.arange(len(seq)) + 2, torch.tensor(seq),
            torch.tensor(prefixes), torch.tensor(news))


@pytest.mark.parametrize("prefixes,news,heads,kv_heads", [
    ([0], [7], 2, 2),                       # no prefix: the square
    ([5], [3], 2, 2),
    ([17, 0, 40], [1, 9, 6], 4, 2),         # mixed batch, GQA
    ([31, 3], [31, 1], 4, 1),
])
def test_new_rows_equal_the_padded_square(prefixes, news, heads, kv_heads) -> None:
    query, k, v, r2t, idx, seq, pre, new = _batch(prefixes, news, heads, kv_heads)
    ref = padded_square_reference(query, k, v, r2t, idx, seq, pre, new, 0.3, kv_heads != heads)
    out = torch.full_like(query, float("nan"))
    got = around_sdpa_forward_extend(None, None, query, out, k, v, r2t, idx, seq, pre, new, None, scaling=0.3,
                                     enable_gqa=kv_heads != heads, causal=True)
    assert got is out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_shifted_mask_lets_token_i_see_the_prefix_and_itself() -> None:
    m = shifted_causal_mask(3, 5)
    assert m.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


def test_cross_attention_windows_and_non_causal_calls_go_to_the_original() -> None:
    calls = []

    def original(self, *args, **kwargs):
        calls.append(kwargs)
        return "original"

    query, k, v, r2t, idx, seq, pre, new = _batch([4], [2], 2, 2)
    out = torch.empty_like(query)
    base = (original, None, query, out, k, v, r2t, idx, seq, pre, new)
    assert around_sdpa_forward_extend(*base, None, causal=False) == "original"
    assert around_sdpa_forward_extend(*base, None, causal=True, is_cross_attn=True) == "original"
    assert around_sdpa_forward_extend(*base, None, causal=True, sliding_window_size=4) == "original"
    assert around_sdpa_forward_extend(*base, torch.tensor([1]), causal=True) == "original"
    assert len(calls) == 4
    assert around_sdpa_forward_extend(*base, None, causal=True, sliding_window_size=-1) is out and len(calls) == 4
