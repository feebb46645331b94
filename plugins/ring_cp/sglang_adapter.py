"""Layer: SGLang adapter of ring_cp. The only module of the plugin that imports SGLang.

An AROUND hook on `sglang.srt.layers.cp.base.init_cp_strategy` replaces the zigzag strategy
with `RingCPStrategy` (a ZigzagCPStrategy subclass: same sharding, metadata and gathers), so
`--enable-prefill-cp --cp-strategy zigzag` plus this plugin selects the ring.

What the ring replaces, and what still needs the full K/V (SGLang 0.5.23):
- Replaced: the attention of the current extend tokens. `materialize_full_kv` keeps this
  rank's K/V shard for the layer, and `run_attention` runs `ring_attention` over it with the
  local queries (FLASH_ATTENTION convention), converting SGLang's prev-then-next local order
  to ours and back; no rank needs the full K/V for this.
- Still full K/V (`keep_full_kv_in_pool=true`, the only supported value): the pool write in
  `materialize_full_kv` (decode reads it, the radix cache shares it across requests, PD
  transfer sends it from every CP rank), and `materialize_full_mla_kv` (MLA). The pool write
  stays an all-gather; it is no longer on the attention's critical path in principle, but this
  scaffold still runs it synchronously before attention.
- Falls back to the zigzag path: extends with a cached prefix (the prefix K/V sits only in the
  pool), backends other than FLASH_ATTENTION (TRT-LLM MHA, DSA, DSv4), and cross-attention.
Not run end to end: that needs multi-GPU SGLang, which no machine here has.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from kllm_plugins import runtime

logger = logging.getLogger("kllm.ring_cp")

_CLASS: type | None = None


def ring_strategy_class() -> type:
    """Build RingCPStrategy lazily (subclassing needs SGLang's zigzag strategy)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch
    from sglang.srt.layers.cp.base import CPAttentionBackendKind
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    from kllm_plugins.plugins.ring_cp.core import ShardPlan, ring_attention, select_block_attention
    from kllm_plugins.plugins.ring_cp.core.sglang_layout import sglang_to_plan

    class RingCPStrategy(ZigzagCPStrategy):
        name = "kllm_ring"

        def __init__(self, cp_size: int, chunks_per_shard: int = 4, kernel: str = "auto",
                     keep_full_kv_in_pool: bool = True) -> None:
            super().__init__(cp_size=cp_size)
            self.chunks_per_shard = chunks_per_shard
            self.kernel = kernel
            self.keep_full_kv_in_pool = keep_full_kv_in_pool
            self._local_kv: dict[int, tuple[Any, Any]] = {}

        def materialize_full_kv(self, forward_batch: Any, layer: Any = None, k: Any = None, v: Any = None,
                                swa_loc: Any | None = None) -> Any:
            if layer is not None and not getattr(layer, "is_cross_attention", False) and k is not None:
                self._local_kv[id(forward_batch)] = (k, v, layer)
            if self.keep_full_kv_in_pool:
                return super().materialize_full_kv(forward_batch, layer, k, v, swa_loc)
            return None

        def _ringable(self, forward_batch: Any, backend: Any, layer: Any) -> bool:
            prefix = getattr(forward_batch, "extend_prefix_lens_cpu", None) or []
            return (backend == CPAttentionBackendKind.FLASH_ATTENTION and layer is not None
                    and forward_batch.attn_cp_metadata is not None and not any(int(p) for p in prefix)
                    and not getattr(layer, "logit_cap", 0) and getattr(layer, "sliding_window_size", -1) in (-1, None))

        def run_attention(self, q: Any, forward_batch: Any, device: Any, attn_fn: Callable[..., Any],
                          attention_backend: Any = CPAttentionBackendKind.FLASH_ATTENTION) -> Any:
            # Always consume the stash so a later batch can never see this layer's K/V.
            k, v, layer = self._local_kv.pop(id(forward_batch), (None, None, None))
            if not self._ringable(forward_batch, attention_backend, layer):
                return super().run_attention(q, forward_batch, device, attn_fn, attention_backend)
            from sglang.srt.runtime_context import get_parallel

            meta = forward_batch.attn_cp_metadata
            seq_lens = _seq_lens(meta, self.cp_size)
            logical = meta.total_q_prev_tokens + meta.total_q_next_tokens
            perm = sglang_to_plan(seq_lens, self.cp_size, self.cp_rank).to(q.device)
            plan = ShardPlan.build(seq_lens, self.cp_size, "zigzag")
            # q arrives (tokens, heads, head_dim) from the FA backend (flattened heads also accepted).
            qv = (q[:logical] if q.dim() == 3 else q[:logical].reshape(logical, -1, k.shape[-1]))[perm]
            kv = [k[:logical].reshape(logical, -1, k.shape[-1])[perm].contiguous(),
                  v[:logical].reshape(logical, -1, v.shape[-1])[perm].contiguous()]
            group = get_parallel().attn_cp_group.device_group
            out, _ = ring_attention(qv, kv, plan, self.cp_rank, group=group, causal=True,
                                    scale=float(layer.scaling), attn=select_block_attention(self.kernel),
                                    chunks_per_shard=self.chunks_per_shard)
            result = torch.empty_like(out)
            result[perm] = out
            pad = q.shape[0] - logical
            if pad > 0:
                result = torch.cat([result, result.new_zeros(pad, *result.shape[1:])], dim=0)
            return result

    _CLASS = RingCPStrategy
    return _CLASS


def _seq_lens(meta: Any, cp_size: int) -> list[int]:
    """Per-sequence extend lengths from zigzag metadata (split_list holds 2*cp blocks per sequence)."""
    n = 2 * cp_size
    blocks = list(meta.split_list)
    return [sum(blocks[i : i + n]) for i in range(0, len(blocks), n)]


def around_init_cp_strategy(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = original(*args, **kwargs)
    cfg = runtime.config_of("ring_cp")
    if not cfg.enable_ring:
        return result
    import sglang.srt.layers.cp.base as base
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    cls = ring_strategy_class()
    current = base._STRATEGY
    if isinstance(current, ZigzagCPStrategy) and not isinstance(current, cls):
        base._STRATEGY = cls(current.cp_size, cfg.chunks_per_shard, cfg.kernel, cfg.keep_full_kv_in_pool)
        logger.info("ring_cp: prefill CP uses the ring (cp_size=%d, chunks_per_shard=%d, kernel=%s)",
                    current.cp_size, cfg.chunks_per_shard, cfg.kernel)
    elif current is not None and not isinstance(current, cls):
        logger.warning("ring_cp: CP strategy %s is not zigzag; the ring is not used", type(current).__name__)
    return result
