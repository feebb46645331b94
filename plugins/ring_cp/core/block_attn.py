"""Layer: ring_cp core (plain torch, no SGLang import). Block attention that returns the log-sum-exp.

`BlockAttention` computes one block pair: queries (Sq, H, D) against keys (Sk, Hkv, D) and
values (Sk, Hkv, Dv), token-major like SGLang's varlen layout, returning out (Sq, H, Dv) in
fp32 and lse (Sq, H) in fp32. `causal=True` is bottom-right aligned: query row i sees keys
0 .. i + (Sk - Sq), which is plain causal when Sq == Sk. Grouped-query attention maps query
head h to key head h // (H // Hkv).

Implementations, picked by `select_block_attention` through the hardware adapter:
- "torch": explicit matmuls in fp32, the reference (any device);
- "sdpa_flash": PyTorch's flash SDPA operator, which returns the LSE (CUDA, fp16/bf16);
- "triton": the kernel in plugins/ring_cp/kernels (CUDA, or CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Callable, Protocol

import torch

logger = logging.getLogger("kllm.ring_cp")


class BlockAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def torch_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    sq, h, _ = q.shape
    sk, hkv, _ = k.shape
    group = h // hkv
    qf = q.float().reshape(sq, hkv, group, -1).permute(1, 2, 0, 3)  # (Hkv, G, Sq, D)
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, Sk, D)
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (Hkv, G, Sq, Sk)
    if causal:
        qi = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
        ki = torch.arange(sk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(ki > qi, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (Hkv, G, Sq)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe.unsqueeze(-1))
    out = torch.matmul(p, vf)  # (Hkv, G, Sq, Dv)
    out = out.permute(2, 0, 1, 3).reshape(sq, h, -1)
    return out, lse.permute(2, 0, 1).reshape(sq, h)


def sdpa_flash_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    sq, h, _ = q.shape
    sk, hkv, _ = k.shape
    if causal and sk > sq:
        # The operator's causal mask is top-left aligned; split off the fully visible prefix.
        from kllm_plugins.plugins.ring_cp.core.lse_merge import merge_into

        o1, l1 = sdpa_flash_block_attention(q, k[: sk - sq], v[: sk - sq], False, scale)
        o2, l2 = sdpa_flash_block_attention(q, k[sk - sq :], v[sk - sq :], True, scale)
        merge_into(o1, l1, o2, l2)
        return o1, l1
    if hkv != h:
        # The flash operator has no GQA; expand this block's heads (transient, one block).
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1)


def triton_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    acc_out: torch.Tensor | None = None, acc_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kllm_plugins.plugins.ring_cp.kernels.flash_lse import flash_attention_lse

    return flash_attention_lse(q, k, v, causal=causal, scale=scale, acc_out=acc_out, acc_lse=acc_lse)


# The kernel merges into a running (out, lse) itself; the ring passes its accumulator slices.
triton_block_attention.accumulates = True  # type: ignore[attr-defined]


IMPLEMENTATIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "torch": torch_block_attention,
    "sdpa_flash": sdpa_flash_block_attention,
    "triton": triton_block_attention,
}


def select_block_attention(name: str = "auto", device_type: str | None = None) -> BlockAttention:
    """Pick a block-attention implementation from what the hardware adapter reports.

    "auto": sdpa_flash on CUDA, torch elsewhere. "triton" on CPU needs TRITON_INTERPRET=1.
    """
    from kllm_plugins.hardware import get_adapter

    adapter = get_adapter(device_type) if device_type else get_adapter()
    kernels = adapter.kernels()
    if name == "auto":
        name = "sdpa_flash" if adapter.device_type == "cuda" else "torch"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"block attention must be one of auto, {', '.join(IMPLEMENTATIONS)}; got {name!r}")
    if name == "sdpa_flash" and adapter.device_type != "cuda":
        raise ValueError("block attention 'sdpa_flash' needs the cuda adapter")
    if name == "triton":
        ok = kernels.get("triton", False) or (
            kernels.get("triton_interpret", False) and os.environ.get("TRITON_INTERPRET") == "1"
        )
        if not ok:
            raise ValueError(f"block attention 'triton' is not available on the {adapter.name} adapter")
    logger.debug("ring_cp block attention: %s on %s", name, adapter.name)
    return IMPLEMENTATIONS[name]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
