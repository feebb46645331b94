"""Layer: SGLang adapter for the kllm_cuda platform. Speculative KV-cache locations.

SGLang's `kernels/ops/speculative/cache_locs.py` picks its Triton kernels by `is_cuda()`, which is
False on kllm_cuda (the process-start guard), and asks an out-of-tree platform for
`get_speculative_cache_locs_fn()` instead; without one, the write window of every speculative
verify step (DSPARK, EAGLE, DFLASH) comes back None and the scheduler dies at its first decode.
`assign_extend_cache_locs` gives SGLang's own Triton kernel back, with its CUDA path's contract:
each request's slots `req_to_token[req, start:end]`, concatenated in request order.
"""
from __future__ import annotations

import torch


def assign_extend_cache_locs(*, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                             start_offset: torch.Tensor, end_offset: torch.Tensor, batch_size: int,
                             draft_token_num: int, device: torch.device | str) -> torch.Tensor:
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs as kernel
    from sglang.srt.utils import next_power_of_2

    out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
    if batch_size:
        kernel[(batch_size,)](req_pool_indices, req_to_token, start_offset, end_offset, out,
                              req_to_token.shape[1], next_power_of_2(batch_size))
    return out
