"""Triton device functions shared by the LSE attention kernels (no SGLang): one online-softmax
step over a block of scores, and the in-place merge of a block's (out, lse) into a running
partial. Fully masked rows (all scores -inf) stay at zero weight instead of producing NaNs."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_step(s, m_i, l_i):
    """Fold scores `s` [rows, keys] into the running max `m_i` and sum `l_i`; returns the block's
    probabilities, the rescale factor of the old accumulator, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def merge_partial(a_o, a_l, out, lse):
    """Merge (out, lse) with a running partial (a_o, a_l) by log-sum-exp weights."""
    mx = tl.maximum(a_l, lse)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp(a_l - mx_safe)
    wb = tl.exp(lse - mx_safe)
    den = wa + wb
    ok = den > 0
    out = (a_o * wa[:, None] + out * wb[:, None]) / tl.where(ok, den, 1.0)[:, None]
    lse = tl.where(ok, mx_safe + tl.log(tl.where(ok, den, 1.0)), float("-inf"))
    return out, lse
