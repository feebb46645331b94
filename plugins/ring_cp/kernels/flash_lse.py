"""Layer: ring_cp device kernel (Triton; no SGLang import). Flash-attention forward that returns the LSE.

One program computes BLOCK_M query rows of one query head against all visible keys of its
key head (grouped-query: key head = query head // group), with an online softmax in fp32.
Token-major tensors (T, H, D) are read through strides, so the ring's chunk buffers and
SGLang-style varlen slices need no copies. `causal` is bottom-right aligned (row i sees keys
0 .. i + Sk - Sq). Runs on CUDA, and on CPU under TRITON_INTERPRET=1 for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .online_softmax import merge_partial, softmax_step


@triton.jit
def _attend_block(
    q, K, V, acc, m_i, l_i, start_n, offs_m, offs_d, offs_dv, sk, diag, kvh,
    stride_kt, stride_kh, stride_vt, stride_vh, scale, D_REAL, DV_REAL,
    BOUNDS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax; BOUNDS/CAUSAL off on blocks every row sees whole."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < sk
    if BOUNDS:
        k = tl.load(K + offs_n[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                    mask=col_ok[None, :] & (offs_d < D_REAL)[:, None], other=0.0)
    else:
        k = tl.load(K + offs_n[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                    mask=(offs_d < D_REAL)[:, None], other=0.0)
    s = tl.dot(q, k) * scale
    if BOUNDS:
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = tl.where(keep, s, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
    if BOUNDS:
        v = tl.load(V + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv < DV_REAL)[None, :], other=0.0)
    else:
        v = tl.load(V + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=(offs_dv < DV_REAL)[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _flash_lse_fwd(
    Q, K, V, O, LSE,
    sq, sk,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
    scale,
    D_REAL, DV_REAL,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < sq
    q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d < D_REAL)[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    diag = sk - sq
    hi = sk
    # Keys below full_hi are visible to every row of this block: those key blocks skip the mask.
    full_hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, (pid_m + 1) * BLOCK_M + diag)
        full_hi = tl.maximum(0, tl.minimum(pid_m * BLOCK_M + diag + 1, hi))
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(q, K, V, acc, m_i, l_i, start_n, offs_m, offs_d, offs_dv, sk, diag, kvh,
                                      stride_kt, stride_kh, stride_vt, stride_vh, scale, D_REAL, DV_REAL,
                                      False, False, BLOCK_N)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(q, K, V, acc, m_i, l_i, start_n, offs_m, offs_d, offs_dv, sk, diag, kvh,
                                      stride_kt, stride_kh, stride_vt, stride_vh, scale, D_REAL, DV_REAL,
                                      True, CAUSAL, BLOCK_N)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = O + offs_m[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
    o_mask = row_ok[:, None] & (offs_dv < DV_REAL)[None, :]
    if ACCUM:
        # O and LSE hold a running partial: merge in place (saves a separate pass over fp32 out).
        a_l = tl.load(LSE + offs_m * stride_lt + h * stride_lh, mask=row_ok, other=float("-inf"))
        a_o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        out, lse = merge_partial(a_o, a_l, out, lse)
    tl.store(O + offs_m[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv < DV_REAL)[None, :])
    tl.store(LSE + offs_m * stride_lt + h * stride_lh, lse, mask=row_ok)


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def lse_output_buffers(acc_out: torch.Tensor | None, acc_lse: torch.Tensor | None, sq: int, h: int,
                       dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 (out, lse) a kernel writes: the caller's accumulators when both are given (checked),
    otherwise fresh buffers of shape (sq, h, dv) and (sq, h)."""
    if acc_out is not None and acc_lse is not None:
        if acc_out.dtype != torch.float32 or acc_lse.dtype != torch.float32 or acc_out.stride(-1) != 1:
            raise ValueError("acc_out/acc_lse must be fp32 with a unit last stride")
        return acc_out, acc_lse
    return (torch.empty(sq, h, dv, dtype=torch.float32, device=device),
            torch.empty(sq, h, dtype=torch.float32, device=device))


def flash_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
    block_m: int | None = None, block_n: int | None = None,
    acc_out: torch.Tensor | None = None, acc_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Sq, H, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv) -> out (Sq, H, Dv) fp32, lse (Sq, H) fp32.

    With acc_out/acc_lse (fp32 running partial for the same rows), the result is merged into
    them in place and they are returned.
    """
    sq, h, d = q.shape
    sk, hkv, _ = k.shape
    dv = v.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of key heads {hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    accum = acc_out is not None and acc_lse is not None
    out, lse = lse_output_buffers(acc_out, acc_lse, sq, h, dv, q.device)
    if sq == 0:
        return out, lse
    on_gpu = q.is_cuda
    bm = block_m or (128 if on_gpu else 16)
    bn = block_n or (64 if on_gpu else 16)
    grid = (triton.cdiv(sq, bm), h)
    kwargs = {"num_warps": 8, "num_stages": 3} if on_gpu else {}
    _flash_lse_fwd[grid](
        q, k, v, out, lse, sq, sk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        float(scale), d, dv,
        GROUP=h // hkv, CAUSAL=bool(causal), ACCUM=accum, BLOCK_M=bm, BLOCK_N=bn, D=_pow2(d), DV=_pow2(dv),
        **kwargs,
    )
    return out, lse
