"""Worker code for tests/gpu/test_ring_cp_gpu.py (spawned, one process per GPU; not a test module)."""
from __future__ import annotations

import math
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F


def run(rank: int, world: int, port: int, err_dir: str) -> None:
    try:
        from kllm_plugins.hardware import get_adapter
        from kllm_plugins.plugins.ring_cp.core import (
            ShardPlan, allgather_attention, ring_attention, select_block_attention,
        )

        adapter = get_adapter()
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(adapter.collective_backend(), init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, device_id=dev)
        g = torch.Generator(device=dev).manual_seed(7)
        for seq_lens, h, hkv, d, causal, chunks in (([8191, 3001], 32, 8, 128, True, 3), ([4096], 16, 16, 64, False, 2)):
            total = sum(seq_lens)
            q = torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
            scale = 1 / math.sqrt(d)
            # Reference: torch SDPA per sequence on the full (unsharded) inputs, fp32 math.
            refs, lo = [], 0
            for n in seq_lens:
                qs, ks, vs = (x[lo:lo + n].float().transpose(0, 1) for x in (q, k, v))
                ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True)
                refs.append(ref.transpose(0, 1))
                lo += n
            ref = torch.cat(refs)
            plan = ShardPlan.build(seq_lens, world, "zigzag")
            ql, kl, vl = (plan.shard(x, rank).contiguous() for x in (q, k, v))
            expect = plan.shard(ref, rank)
            for kernel in ("sdpa_flash", "triton"):
                attn = select_block_attention(kernel)
                for name, fn, kw in (("ring", ring_attention, {"chunks_per_shard": chunks}),
                                     ("allgather", allgather_attention, {})):
                    out, lse = fn(ql, [kl, vl], plan, rank, causal=causal, scale=scale, attn=attn, **kw)
                    err = (out.float() - expect).abs().max().item()
                    # bf16 output rounding of values of magnitude <~ 4: 2^-8 relative.
                    assert err < 2e-2, (name, kernel, seq_lens, causal, err)
                    assert torch.isfinite(lse).all()
            print(f"rank {rank}: ring/allgather == SDPA for {seq_lens} causal={causal}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
