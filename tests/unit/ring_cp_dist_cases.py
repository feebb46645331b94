"""Worker code for the multi-process ring_cp tests (imported by spawned processes; not a test module)."""
from __future__ import annotations

import math
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention per sequence in float64 (independent of the code under test)."""
    outs, lses = [], []
    lo = 0
    h, hkv = q.shape[1], k.shape[1]
    for n in seq_lens:
        qs = q[lo:lo + n].double().transpose(0, 1)
        ks = k[lo:lo + n].double().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        vs = v[lo:lo + n].double().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        lo += n
    return torch.cat(outs), torch.cat(lses)


def make_case(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"])
    total = sum(case["seq_lens"])
    h, hkv, d, dv = case["h"], case["hkv"], case["d"], case.get("dv", case["d"])
    q = torch.randn(total, h, d, generator=g)
    if case.get("layout", "kv") == "latent":
        lat = torch.randn(total, 1, d, generator=g)
        return {"q": q, "latent": lat, "k": lat, "v": lat[..., :dv]}
    return {"q": q, "k": torch.randn(total, hkv, d, generator=g), "v": torch.randn(total, hkv, dv, generator=g)}


def run_cases(rank: int, world: int, init_file: str, cases: list[dict[str, Any]], err_dir: str) -> None:
    from kllm_plugins.hardware import get_adapter
    from kllm_plugins.plugins.ring_cp.core import (
        GatherStats, RingStats, ShardPlan, allgather_attention, ring_attention, select_block_attention,
    )

    try:
        backend = get_adapter("cpu").collective_backend()
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        for case in cases:
            if case.get("sparse_topk"):
                _sparse_case(rank, world, case)
                continue
            t = make_case(case)
            dtype = case.get("dtype", torch.float32)
            plan = ShardPlan.build(case["seq_lens"], world, case.get("mode", "zigzag"))
            scale = 1.0 / math.sqrt(case["d"])
            ref_out, ref_lse = reference(t["q"].to(dtype), t["k"].to(dtype), t["v"].to(dtype),
                                         case["seq_lens"], case["causal"], scale)
            layout = case.get("layout", "kv")
            payload_full = [t["latent"]] if layout == "latent" else [t["k"], t["v"]]
            q_loc = plan.shard(t["q"], rank).to(dtype)
            payload = [plan.shard(p, rank).to(dtype).contiguous() for p in payload_full]
            attn = select_block_attention(case.get("attn", "torch"), "cpu")
            rstats = RingStats()
            out, lse = ring_attention(q_loc, payload, plan, rank, causal=case["causal"], scale=scale, attn=attn,
                                      layout=layout, v_dim=case.get("dv"), chunks_per_shard=case.get("chunks", 1),
                                      stats=rstats)
            gout, glse = allgather_attention(q_loc, payload, plan, rank, causal=case["causal"], scale=scale,
                                             attn=attn, layout=layout, v_dim=case.get("dv"), stats=GatherStats())
            exp_out, exp_lse = plan.shard(ref_out, rank), plan.shard(ref_lse, rank)
            tol = case["tol"]
            for name, o, l in (("ring", out, lse), ("allgather", gout, glse)):
                assert o.dtype == dtype, (name, o.dtype)
                err_o = (o.double() - exp_out).abs().max().item() if o.numel() else 0.0
                err_l = (l.double() - exp_lse).abs().max().item() if l.numel() else 0.0
                if not (err_o <= tol and err_l <= tol):
                    raise AssertionError(f"{name} rank {rank} case {case}: max |out err| {err_o:.3g}, "
                                         f"max |lse err| {err_l:.3g}, tol {tol}")
            # Per-rank K/V memory: own shard plus two chunk buffers, never the whole sequence.
            nch = case.get("chunks", 1)
            longest = max(plan.local_len(r) for r in range(world))
            per_tok = sum(p[0].numel() * p.element_size() for p in payload) if payload[0].shape[0] else 0
            if world > 1 and per_tok:
                max_chunk = max(plan.chunk_len(r, nch, c) for r in range(world) for c in range(nch))
                # Each segment's slice rounds up by at most one token.
                assert max_chunk <= -(-longest // nch) + max(len(s) for s in plan.segments)
                assert rstats.buffer_bytes == 2 * max_chunk * per_tok, (rstats.buffer_bytes, max_chunk, per_tok)
                assert rstats.steps == (world - 1) * case.get("chunks", 1)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _sparse_case(rank: int, world: int, case: dict[str, Any]) -> None:
    from kllm_plugins.plugins.ring_cp.core import ShardPlan
    from kllm_plugins.plugins.ring_cp.core.sparse_topk import allgather_sparse_attention, ring_sparse_attention

    g = torch.Generator().manual_seed(case["seed"])
    seq_lens, h, d, dv, topk = case["seq_lens"], case["h"], case["d"], case["dv"], case["topk"]
    total = sum(seq_lens)
    q = torch.randn(total, h, d, generator=g)
    lat = torch.randn(total, 1, d, generator=g)
    # A stand-in indexer: each query picks up to topk random keys at or before itself in its sequence.
    idx = torch.full((total, topk), -1, dtype=torch.int64)
    mask = torch.zeros(total, total, dtype=torch.bool)
    base = 0
    for n in seq_lens:
        for i in range(n):
            pick = torch.randperm(i + 1, generator=g)[:topk] + base
            idx[base + i, : pick.numel()] = pick
            mask[base + i, pick] = True
        base += n
    scale = 1.0 / math.sqrt(d)
    s = torch.einsum("thd,kd->htk", q.double(), lat[:, 0].double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(s, -1).transpose(0, 1)
    ref_out = (torch.softmax(s, -1) @ lat[:, 0, :dv].double()).transpose(0, 1)
    plan = ShardPlan.build(seq_lens, world, "zigzag")
    ql, ll, il = plan.shard(q, rank), plan.shard(lat, rank).contiguous(), plan.shard(idx, rank)
    eo, el = plan.shard(ref_out, rank), plan.shard(ref_lse, rank)
    kernel = case.get("kernel", "torch")
    if kernel == "triton":
        # The kernels run under Triton's interpreter on CPU (set before their module is imported).
        os.environ["TRITON_INTERPRET"] = "1"
    paths: list[tuple[str, Any, dict[str, Any]]] = [
        ("ring", ring_sparse_attention, {"chunks_per_shard": case.get("chunks", 1)}),
        ("allgather", allgather_sparse_attention, {}),
    ]
    if kernel == "triton":
        paths.append(("allgather in key blocks", allgather_sparse_attention, {"key_blocks": 3}))
    for name, fn, kw in paths:
        out, lse = fn(ql, ll, il, plan, rank, scale=scale, v_dim=dv, q_chunk=7, kernel=kernel, **kw)
        err_o = (out.double() - eo).abs().max().item()
        err_l = (lse.double() - el).abs().max().item()
        if not (err_o <= case["tol"] and err_l <= case["tol"]):
            raise AssertionError(f"sparse {name} rank {rank}: out err {err_o:.3g}, lse err {err_l:.3g}")
