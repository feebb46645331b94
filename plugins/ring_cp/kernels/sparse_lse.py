"""Layer: ring_cp device kernels (Triton; no SGLang import). Sparse top-k attention over a shared latent.

Two kernels for DSA-style sparse attention, where each query attends only to the keys an
indexer picked for it, over an MLA-style latent (T, 1, D) with v = latent[..., :DV]:

- `bucket_topk`: one program per query row. It splits the row's selections by the group that
  holds each key (for the ring: this rank's own shard, or one remote chunk) with a counting
  sort (a prefix sum per group; no comparison sort), writes each selection's row offset inside
  its group's buffer, and the per-group start offsets. It runs once per layer.
- `sparse_latent_attention`: one program per query, all of its heads at once (the heads are
  the rows of the tile, so each gathered key row is read once for every head). It walks the
  query's selections in one group (or its whole index row), gathers those latent rows, runs an
  online softmax in fp32, and either writes (out, lse) or merges into a running partial in
  place. A query with no selection in the group touches no memory in merge mode.

Both run on CUDA, and on CPU under TRITON_INTERPRET=1 for tests.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .flash_lse import lse_output_buffers
from .online_softmax import merge_partial, softmax_step

logger = logging.getLogger("kllm.ring_cp")


@triton.jit
def _bucket_topk(
    IDX, GROUP_OF, LOCAL_OF, OUT, STARTS,
    k, stride_it, stride_ot, stride_st, ngroups,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    ok = offs < k
    ix = tl.load(IDX + t * stride_it + offs, mask=ok, other=-1).to(tl.int64)
    valid = ok & (ix >= 0)
    safe = tl.where(valid, ix, 0)
    g = tl.load(GROUP_OF + safe, mask=valid, other=-1)
    g = tl.where(valid, g, -1)
    loc = tl.load(LOCAL_OF + safe, mask=valid, other=0)
    base = tl.sum(tl.zeros([BLOCK_K], tl.int32), 0)
    for gg in range(0, ngroups):
        sel = (g == gg).to(tl.int32)
        pos = tl.cumsum(sel, 0) - 1 + base
        tl.store(OUT + t * stride_ot + pos, loc, mask=sel > 0)
        tl.store(STARTS + t * stride_st + gg, base)
        base += tl.sum(sel, 0)
    tl.store(STARTS + t * stride_st + ngroups, base)


@triton.jit
def _sparse_latent_fwd(
    Q, KV, IDX, STARTS, O, LSE,
    h, count, group,
    stride_qt, stride_qh, stride_kt, stride_it, stride_st, stride_ot, stride_oh, stride_lt, stride_lh,
    scale, D_REAL, DV_REAL,
    HAS_STARTS: tl.constexpr, ACCUM: tl.constexpr, SAME_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_STARTS:
        lo = tl.load(STARTS + t * stride_st + group)
        hi = tl.load(STARTS + t * stride_st + group + 1)
    else:
        lo = 0
        hi = count
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    h_ok = offs_h < h
    d_ok = offs_d < D_REAL
    dv_ok = offs_dv < DV_REAL
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows = tl.load(IDX + t * stride_it + offs_n, mask=offs_n < hi, other=-1).to(tl.int64)
        r_ok = rows >= 0
        rows = tl.where(r_ok, rows, 0)
        k = tl.load(KV + rows[:, None] * stride_kt + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(r_ok[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        if SAME_V:
            v = k
        else:
            v = tl.load(KV + rows[:, None] * stride_kt + offs_dv[None, :], mask=r_ok[:, None] & dv_ok[None, :],
                        other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = O + t * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :]
    l_ptrs = LSE + t * stride_lt + offs_h * stride_lh
    o_mask = h_ok[:, None] & dv_ok[None, :]
    l_mask = h_ok
    if ACCUM:
        # Merge into the running partial; a query with nothing in this group leaves it untouched.
        busy = hi > lo
        o_mask = o_mask & busy
        l_mask = l_mask & busy
        a_l = tl.load(l_ptrs, mask=l_mask, other=float("-inf"))
        a_o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        out, lse = merge_partial(a_o, a_l, out, lse)
    tl.store(o_ptrs, out, mask=o_mask)
    tl.store(l_ptrs, lse, mask=l_mask)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


def bucket_topk(
    idx: torch.Tensor, group_of: torch.Tensor, local_of: torch.Tensor, ngroups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """idx (Sq, K) global key ids (-1 unused) -> (offsets (Sq, K) int32, starts (Sq, ngroups + 1) int32).

    Row t's selections in group g are offsets[t, starts[t, g] : starts[t, g + 1]], each the row
    of that key inside group g's buffer (`local_of`), in the row's original order. Slots past
    starts[t, ngroups] (unused selections) are unspecified.
    """
    sq, k = idx.shape
    out = torch.empty(sq, k, dtype=torch.int32, device=idx.device)
    starts = torch.empty(sq, ngroups + 1, dtype=torch.int32, device=idx.device)
    if sq == 0:
        return out, starts
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    _bucket_topk[(sq,)](
        idx, group_of, local_of, out, starts, k, idx.stride(0), out.stride(0), starts.stride(0), ngroups,
        BLOCK_K=_pow2(k),
    )
    return out, starts


# Tried in order on the first launch of a shape; a config that runs out of shared memory is dropped.
# (At D = 512, BLOCK_N 64 with 4 warps spills registers on sm_90; with 8 it does not.)
CONFIGS: tuple[dict[str, int], ...] = (
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
    {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
)
_chosen: dict[tuple[int, int, bool], int] = {}


def sparse_latent_attention(
    q: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, *, scale: float, v_dim: int,
    starts: torch.Tensor | None = None, group: int = 0,
    acc_out: torch.Tensor | None = None, acc_lse: torch.Tensor | None = None,
    config: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Sq, H, D) against latent rows: out (Sq, H, v_dim) fp32, lse (Sq, H) fp32.

    rows (Sq, K): row ids into `latent` (-1 skipped). With `starts` (from `bucket_topk`), only
    rows[t, starts[t, group] : starts[t, group + 1]] are used. With acc_out/acc_lse the result
    is merged into that running partial in place and returned. `config` forces an entry of
    CONFIGS on CUDA (the benchmark times them); otherwise the first that fits is used.
    """
    sq, h, d = q.shape
    if latent.dim() != 3 or latent.shape[1] != 1:
        raise ValueError(f"latent must be (T, 1, D), got {tuple(latent.shape)}")
    for name, t in (("q", q), ("latent", latent)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    accum = acc_out is not None and acc_lse is not None
    out, lse = lse_output_buffers(acc_out, acc_lse, sq, h, v_dim, q.device)
    if sq == 0:
        return out, lse
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dp, dvp = _pow2(d), _pow2(v_dim)
    same_v = dp == dvp and d == v_dim
    st = starts if starts is not None else rows  # unused pointer when HAS_STARTS is false
    args = (
        q, latent, rows, st, out, lse, h, rows.shape[1], group,
        q.stride(0), q.stride(1), latent.stride(0), rows.stride(0), st.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        float(scale), d, v_dim,
    )
    meta = dict(HAS_STARTS=starts is not None, ACCUM=accum, SAME_V=same_v, BLOCK_H=_pow2(h), D=dp, DV=dvp)
    if not q.is_cuda:
        _sparse_latent_fwd[(sq,)](*args, BLOCK_N=16, **meta)
        return out, lse
    key = (dp, dvp, same_v)
    first = config if config is not None else _chosen.get(key, 0)
    for i in range(first, len(CONFIGS)):
        cfg = dict(CONFIGS[i])
        try:
            _sparse_latent_fwd[(sq,)](*args, BLOCK_N=cfg.pop("BLOCK_N"), **cfg, **meta)
        except triton.runtime.errors.OutOfResources as exc:
            if config is not None:
                raise
            logger.info("ring_cp sparse kernel config %s out of resources (%s); trying the next", CONFIGS[i], exc)
            continue
        if config is None:
            _chosen[key] = i
        return out, lse
    raise RuntimeError("no sparse attention kernel config fits this device")
