"""Benchmark (GPU, several processes): ring attention against all-gather CP (SGLang zigzag semantics).

Cases (issue 6): dense causal attention overlap (ring vs all-gather vs compute-only), K/V memory
per rank and the longest context under a per-GPU budget, a batch of long prompts under a fixed
K/V budget, sparse top-k (DSA-style) attention, and load balance (zigzag vs contiguous).
One process per GPU, NCCL from the CUDA adapter. Times are the slowest rank's, medians over reps.

    python benchmarks/ring_cp/bench_ring.py --gpus 2 --json benchmarks/results/ring_cp.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, HKV, D = 32, 8, 128
_DEV = torch.device("cpu")
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # k and v, bf16


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median over reps of the slowest rank's wall time (ms); also each rank's median."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        dt = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(dt)
    mine = statistics.median(times)
    t = torch.tensor(times, device=_DEV)
    world = dist.get_world_size()
    allt = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(allt, t)
    per_rank = [statistics.median(x.tolist()) for x in allt]
    slowest = torch.stack(allt).max(dim=0).values.tolist()
    return statistics.median(slowest), per_rank


def _peak(fn: Callable[[], Any]) -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t = torch.tensor([peak], device=_DEV, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _dense_inputs(plan: Any, rank: int, dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    n = plan.local_len(rank)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, [k, v]


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, out_file: str,
            heads: tuple[int, int, int]) -> None:
    global H, HKV, D, KV_BYTES_PER_TOKEN
    H, HKV, D = heads
    KV_BYTES_PER_TOKEN = 2 * HKV * D * 2
    from kllm_plugins.hardware import get_adapter
    from kllm_plugins.plugins.ring_cp.core import (
        GatherStats, RingStats, ShardPlan, allgather_attention, gather_full_kv, ring_attention,
        select_block_attention,
    )
    from kllm_plugins.plugins.ring_cp.core.sparse_topk import allgather_sparse_attention, ring_sparse_attention

    global _DEV
    adapter = get_adapter()
    dev = torch.device("cpu")
    if adapter.device_type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    _DEV = dev
    dist.init_process_group(adapter.collective_backend(), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)
    attn = select_block_attention(args.kernel)
    scale = 1.0 / math.sqrt(D)
    points: list[dict[str, Any]] = []

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    def dense_point(tokens: int, reps: int, chunks: int, mode: str = "zigzag", case: str = "dense",
                    seq_lens: list[int] | None = None) -> dict[str, Any]:
        plan = ShardPlan.build(seq_lens or [tokens], world, mode)
        q, kv = _dense_inputs(plan, rank, dev)
        rs, gs = RingStats(), GatherStats()
        ring = lambda: ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=chunks, stats=rs)
        comp = lambda: ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=chunks, comm=False)
        ag = lambda: allgather_attention(q, kv, plan, rank, attn=attn, scale=scale, stats=gs)
        gather_only = lambda: gather_full_kv(kv, plan, rank, None, GatherStats())
        ring_ms, ring_ranks = _timed(ring, reps)
        comp_ms, comp_ranks = _timed(comp, reps)
        ag_ms, _ = _timed(ag, reps)
        gather_ms, _ = _timed(gather_only, reps)
        ring_peak = _peak(ring)
        ag_peak = _peak(ag)
        pt = {
            "case": case, "gpus": world, "tokens": sum(plan.seq_lens), "seqs": len(plan.seq_lens), "mode": mode,
            "kernel": args.kernel, "chunks_per_shard": chunks,
            "allgather_ms": round(ag_ms, 3), "ring_ms": round(ring_ms, 3), "compute_only_ms": round(comp_ms, 3),
            "gather_only_ms": round(gather_ms, 3), "speedup": round(ag_ms / ring_ms, 4),
            "ring_over_compute": round(ring_ms / comp_ms, 4),
            "ring_rank_ms": [round(x, 3) for x in ring_ranks], "compute_rank_ms": [round(x, 3) for x in comp_ranks],
            "peak_kv_bytes_per_rank": rs.peak_kv_bytes, "allgather_peak_kv_bytes_per_rank": gs.peak_kv_bytes,
            "full_kv_bytes": sum(plan.seq_lens) * KV_BYTES_PER_TOKEN,
            "measured_peak_extra_bytes_ring": ring_peak, "measured_peak_extra_bytes_allgather": ag_peak,
            "bytes_sent_per_rank": rs.bytes_sent,
        }
        log(f"[{case}] tokens={pt['tokens']} mode={mode} allgather {ag_ms:.2f} ms  ring {ring_ms:.2f} ms  "
            f"compute-only {comp_ms:.2f} ms  gather {gather_ms:.2f} ms  ratio ag/ring {pt['speedup']:.3f}  "
            f"ring/compute {pt['ring_over_compute']:.3f}  peak KV ring {rs.peak_kv_bytes / 2**30:.2f} GiB "
            f"vs allgather {gs.peak_kv_bytes / 2**30:.2f} GiB")
        del q, kv
        torch.cuda.empty_cache()
        return pt

    if "dense" in args.cases:
        for tokens in args.tokens:
            reps = 2 if tokens >= 262144 else 3
            points.append(dense_point(tokens, reps, args.chunks))

    if "balance" in args.cases:
        for mode in ("zigzag", "contiguous"):
            pt = dense_point(args.balance_tokens, 2, args.chunks, mode=mode, case="load_balance")
            ranks = pt["ring_rank_ms"]
            pt["slowest_over_mean"] = round(max(ranks) / statistics.mean(ranks), 4)
            pcomp = pt["compute_rank_ms"]
            pt["compute_slowest_over_mean"] = round(max(pcomp) / statistics.mean(pcomp), 4)
            plan = ShardPlan.build([args.balance_tokens], world, mode)
            work = [plan.causal_work(r) for r in range(world)]
            pt["work_slowest_over_mean"] = round(max(work) / statistics.mean(work), 4)
            log(f"[balance] {mode}: slowest/mean rank time {pt['slowest_over_mean']} (compute-only "
                f"{pt['compute_slowest_over_mean']}, causal work {pt['work_slowest_over_mean']})")
            points.append(pt)

    if "batch" in args.cases:
        # A fixed per-GPU K/V budget; each method runs the largest batch its per-rank K/V peak allows.
        n_prompts, plen = args.batch_prompts, args.batch_prompt_tokens
        per_prompt = plen * KV_BYTES_PER_TOKEN
        budget = args.batch_budget_gib * 2**30
        ring_per = per_prompt / world * (1 + 2 / args.chunks)
        ag_per = per_prompt * (1 / world + 1 + 1)  # local shard + gather buffer + reordered full K/V
        b_ring = max(1, min(n_prompts, int(budget // ring_per)))
        b_ag = max(1, min(n_prompts, int(budget // ag_per)))
        plans = {}

        def run_all(kind: str, bsz: int) -> None:
            for lo in range(0, n_prompts, bsz):
                lens = [plen] * min(bsz, n_prompts - lo)
                plan = plans.setdefault((kind, len(lens)), ShardPlan.build(lens, world, "zigzag"))
                q, kv = inputs[len(lens)]
                if kind == "ring":
                    ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=args.chunks)
                elif kind == "compute":
                    ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=args.chunks,
                                   comm=False)
                else:
                    allgather_attention(q, kv, plan, rank, attn=attn, scale=scale)

        inputs = {}
        for bsz in {b_ring, b_ag, n_prompts % b_ring or b_ring, n_prompts % b_ag or b_ag}:
            inputs[bsz] = _dense_inputs(ShardPlan.build([plen] * bsz, world, "zigzag"), rank, dev)
        ring_ms, _ = _timed(lambda: run_all("ring", b_ring), 2)
        comp_ms, _ = _timed(lambda: run_all("compute", b_ring), 2)
        ag_ms, _ = _timed(lambda: run_all("ag", b_ag), 2)
        pt = {"case": "memory_bound_batch", "gpus": world, "tokens": n_prompts * plen, "prompts": n_prompts,
              "prompt_tokens": plen, "budget_bytes_per_rank": budget, "ring_batch": b_ring, "allgather_batch": b_ag,
              "allgather_ms": round(ag_ms, 3), "ring_ms": round(ring_ms, 3), "compute_only_ms": round(comp_ms, 3),
              "speedup": round(ag_ms / ring_ms, 4), "kernel": args.kernel,
              "peak_kv_bytes_per_rank": int(ring_per * b_ring), "allgather_peak_kv_bytes_per_rank": int(ag_per * b_ag),
              "full_kv_bytes": n_prompts * per_prompt}
        log(f"[batch] {n_prompts}x{plen} budget {args.batch_budget_gib} GiB: ring batch {b_ring} {ring_ms:.1f} ms, "
            f"allgather batch {b_ag} {ag_ms:.1f} ms, compute-only {comp_ms:.1f} ms, ratio {pt['speedup']:.3f}")
        points.append(pt)
        del inputs
        torch.cuda.empty_cache()

    if "sparse" in args.cases:
        sh, sd = args.sparse_heads, args.sparse_dim
        for tokens in args.sparse_tokens:
            plan = ShardPlan.build([tokens], world, "zigzag")
            n = plan.local_len(rank)
            g = torch.Generator(device=dev).manual_seed(99 + rank)
            q = torch.randn(n, sh, sd, device=dev, dtype=torch.bfloat16, generator=g)
            lat = torch.randn(n, 1, sd, device=dev, dtype=torch.bfloat16, generator=g)
            pos = plan.global_index(rank, dev)
            # Stand-in indexer output: topk positions at or before each query (with replacement).
            idx = torch.empty(n, args.topk, dtype=torch.int32, device=dev)
            for lo in range(0, n, 16384):
                hi = min(n, lo + 16384)
                r = torch.rand(hi - lo, args.topk, device=dev, generator=g)
                idx[lo:hi] = (r * (pos[lo:hi, None] + 1).float()).long().clamp(max=tokens - 1).to(torch.int32)
            rs, gs = RingStats(), GatherStats()
            ring = lambda: ring_sparse_attention(q, lat, idx, plan, rank, scale=1 / math.sqrt(sd),
                                                 chunks_per_shard=args.chunks, stats=rs, q_chunk=args.ring_q_chunk)
            comp = lambda: ring_sparse_attention(q, lat, idx, plan, rank, scale=1 / math.sqrt(sd),
                                                 chunks_per_shard=args.chunks, comm=False, q_chunk=args.ring_q_chunk)
            ag = lambda: allgather_sparse_attention(q, lat, idx, plan, rank, scale=1 / math.sqrt(sd), stats=gs,
                                                    q_chunk=args.q_chunk)
            ring_ms, _ = _timed(ring, 2)
            comp_ms, _ = _timed(comp, 2)
            ag_ms, _ = _timed(ag, 2)
            pt = {"case": "sparse_topk", "gpus": world, "tokens": tokens, "topk": args.topk, "heads": sh,
                  "latent_dim": sd, "allgather_ms": round(ag_ms, 3), "ring_ms": round(ring_ms, 3),
                  "compute_only_ms": round(comp_ms, 3), "speedup": round(ag_ms / ring_ms, 4),
                  "peak_kv_bytes_per_rank": rs.peak_kv_bytes, "allgather_peak_kv_bytes_per_rank": gs.peak_kv_bytes,
                  "full_kv_bytes": tokens * sd * 2, "kernel": "torch_gather",
                  "q_chunk_allgather": args.q_chunk, "q_chunk_ring": args.ring_q_chunk}
            log(f"[sparse] tokens={tokens} topk={args.topk}: allgather {ag_ms:.1f} ms  ring {ring_ms:.1f} ms  "
                f"compute-only {comp_ms:.1f} ms  ratio {pt['speedup']:.3f}")
            points.append(pt)
            del q, lat, idx
            torch.cuda.empty_cache()

    if rank == 0:
        Path(out_file).write_text(json.dumps(points))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    global H, HKV, D, KV_BYTES_PER_TOKEN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cases", default="dense,balance,batch,sparse")
    ap.add_argument("--kernel", default="sdpa_flash", choices=["sdpa_flash", "triton", "torch"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072, 262144, 524288])
    ap.add_argument("--chunks", type=int, default=4, help="chunks per shard on the ring")
    ap.add_argument("--balance-tokens", type=int, default=262144)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--batch-prompt-tokens", type=int, default=65536)
    ap.add_argument("--batch-budget-gib", type=float, default=2.0)
    ap.add_argument("--sparse-tokens", type=int, nargs="+", default=[131072, 262144, 524288])
    ap.add_argument("--sparse-heads", type=int, default=16)
    ap.add_argument("--sparse-dim", type=int, default=512)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--q-chunk", type=int, default=1024, help="query block of the all-gather sparse path")
    ap.add_argument("--ring-q-chunk", type=int, default=1024, help="query block of the ring sparse path")
    ap.add_argument("--heads", type=int, nargs=3, default=[H, HKV, D], metavar=("H", "HKV", "D"))
    ap.add_argument("--json", default="benchmarks/results/ring_cp.json")
    ap.add_argument("--results-md", default="benchmarks/RESULTS.md")
    args = ap.parse_args()
    args.cases = set(args.cases.split(","))
    H, HKV, D = args.heads
    KV_BYTES_PER_TOKEN = 2 * HKV * D * 2
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = f"/tmp/ring_cp_bench_{os.getpid()}.json"
    mp.spawn(_worker, args=(args.gpus, args, port, tmp, (H, HKV, D)), nprocs=args.gpus, join=True)
    points = json.loads(Path(tmp).read_text())
    command = "python " + " ".join(sys.argv)
    for p in points:
        p["command"] = command
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"command": command, "device": device, "torch": torch.__version__,
           "points": points}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
