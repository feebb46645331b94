"""Worker for test_ring_cp_adapter.py: RingCPStrategy.run_attention over gloo with real SGLang zigzag metadata."""
from __future__ import annotations

import math
import os
import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist


def run(rank: int, world: int, init_file: str, err_dir: str) -> None:
    try:
        os.environ.setdefault("SGLANG_PLATFORM", "kllm_cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        import sglang.srt.layers.cp.base as base
        import sglang.srt.runtime_context as rc

        from kllm_plugins import runtime
        from kllm_plugins.plugins.ring_cp.config import RingCPConfig
        from kllm_plugins.plugins.ring_cp.sglang_adapter import ring_strategy_class

        par = SimpleNamespace(attn_cp_rank=rank, attn_cp_group=SimpleNamespace(device_group=None))
        base.get_parallel = lambda: par  # type: ignore[assignment]
        rc.get_parallel = lambda: par  # type: ignore[assignment]
        runtime.set_config("ring_cp", RingCPConfig(chunks_per_shard=2, kernel="torch"))
        strat = ring_strategy_class()(world, 2, "torch", True)

        seq_lens, h, hkv, d = [37, 26], 4, 2, 8
        total = sum(seq_lens)
        g = torch.Generator().manual_seed(5)
        q, k, v = torch.randn(total, h, d, generator=g), torch.randn(total, hkv, d, generator=g), torch.randn(total, hkv, d, generator=g)
        scale = 1 / math.sqrt(d)
        ref = torch.empty(total, h, d, dtype=torch.float64)
        lo = 0
        for n in seq_lens:
            qs = q[lo:lo + n].double().transpose(0, 1)
            ks = k[lo:lo + n].double().repeat_interleave(h // hkv, 1).transpose(0, 1)
            vs = v[lo:lo + n].double().repeat_interleave(h // hkv, 1).transpose(0, 1)
            s = (qs @ ks.transpose(-1, -2) * scale).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            ref[lo:lo + n] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
            lo += n

        meta = strat.build_metadata(total, None, seq_lens)
        chunks = torch.split(torch.arange(total), meta.split_list)
        local = torch.cat([chunks[i] for i in meta.zigzag_index])
        layer = SimpleNamespace(scaling=scale, logit_cap=0, sliding_window_size=-1, is_cross_attention=False)
        fb = SimpleNamespace(attn_cp_metadata=meta, extend_prefix_lens_cpu=[0, 0])
        strat._local_kv[id(fb)] = (k[local], v[local], layer)  # what materialize_full_kv stashes
        out = strat.run_attention(q[local], fb, "cpu", attn_fn=None)
        err = (out.double() - ref[local]).abs().max().item()
        assert out.shape == (local.numel(), h, d), out.shape
        assert err < 2e-5, err
        assert id(fb) not in strat._local_kv

        # A cached prefix falls back to SGLang's zigzag path (the prefix K/V lives only in the pool).
        calls: list[Any] = []

        def fake_attn(q_chunk: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(q_chunk.shape[0])
            return torch.zeros_like(q_chunk)

        fb2 = SimpleNamespace(attn_cp_metadata=meta, extend_prefix_lens_cpu=[5, 0])
        strat._local_kv[id(fb2)] = (k[local], v[local], layer)
        strat.run_attention(q[local], fb2, "cpu", attn_fn=fake_attn)
        assert calls == [meta.total_q_prev_tokens, meta.total_q_next_tokens], calls
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
