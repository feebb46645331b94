"""Benchmark (GPU, several processes): ring attention against all-gather CP (SGLang zigzag semantics).

Cases (issue 6), in this order so that a time budget keeps the most informative ones:
- sparse top-k (DSA-style) attention over a shared latent, 128K-512K tokens (Triton kernels on
  both sides; the all-gather at its best config);
- a batch of long prompts under a fixed per-GPU K/V budget (each side runs the largest batch
  its K/V peak allows, same attention kernel);
- dense causal attention 64K-512K (overlap; ring vs compute-only vs all-gather), with K/V memory;
- load balance (zigzag vs contiguous shards).
For every all-gather point the gather step (and the bare NCCL collective) and the attention on
pre-gathered K/V are also timed on their own, which gives the ceiling of any overlap:
(t_comm + t_compute) / max(t_comm, t_compute). One process per GPU, NCCL from the CUDA adapter;
times are the slowest rank's, medians over reps. The JSON is rewritten after every point.

    python benchmarks/ring_cp/bench_ring.py --gpus 2 --json benchmarks/results/ring_cp.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_timing import Bench, split_fields  # noqa: E402

H, HKV, D = 32, 8, 128


def kv_bytes_per_token() -> int:
    return 2 * HKV * D * 2  # k and v, bf16


def _dense_inputs(plan: Any, rank: int, dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    n = plan.local_len(rank)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    mk = lambda h: torch.randn(n, h, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(H), [mk(HKV), mk(HKV)]


def _collective_only(payload: list[torch.Tensor]) -> Any:
    """The bare all_gather_into_tensor of every payload tensor into preallocated buffers."""
    world = dist.get_world_size()
    bufs = [p.new_empty((p.shape[0] * world, *p.shape[1:])) for p in payload]
    return lambda: [dist.all_gather_into_tensor(b, p) for b, p in zip(bufs, payload)]


class Runner:
    def __init__(self, rank: int, world: int, args: argparse.Namespace, dev: torch.device, out_file: str) -> None:
        from kllm_plugins.plugins.ring_cp import core

        self.core, self.rank, self.world, self.args, self.dev = core, rank, world, args, dev
        self.b = Bench(dev, args.deadline_s)
        self.out_file = out_file
        self.points: list[dict[str, Any]] = []
        self.skipped: list[str] = []

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{self.b.elapsed():6.1f}s] {msg}", flush=True)

    def add(self, pt: dict[str, Any]) -> None:
        pt["gpus"] = self.world
        self.points.append(pt)
        if self.rank == 0:
            Path(self.out_file).write_text(json.dumps({"points": self.points, "skipped": self.skipped}))

    def budget(self, what: str, need_s: float) -> bool:
        if self.b.has_time(need_s):
            return True
        self.skipped.append(what)
        self.log(f"skip {what}: needs ~{need_s:.0f} s, past the budget")
        return False

    # ---------------------------------------------------------------- dense
    def dense(self, kernel: str, tokens: int, mode: str = "zigzag", case: str = "dense", with_ag: bool = True,
              peaks: bool = True) -> dict[str, Any]:
        c, rank, a = self.core, self.rank, self.args
        attn = c.select_block_attention(kernel)
        scale = 1.0 / math.sqrt(D)
        reps = 2 if tokens >= 262144 else 3
        plan = c.ShardPlan.build([tokens], self.world, mode)
        q, kv = _dense_inputs(plan, rank, self.dev)
        rs, gs = c.RingStats(), c.GatherStats()
        ring = lambda: c.ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=a.chunks,
                                        stats=rs)
        comp = lambda: c.ring_attention(q, kv, plan, rank, attn=attn, scale=scale, chunks_per_shard=a.chunks,
                                        comm=False)
        ring_ms, ring_ranks = self.b.timed(ring, reps)
        comp_ms, comp_ranks = self.b.timed(comp, reps)
        pt: dict[str, Any] = {
            "case": case, "tokens": tokens, "seqs": 1, "mode": mode, "kernel": kernel, "chunks_per_shard": a.chunks,
            "ring_ms": round(ring_ms, 3), "compute_only_ms": round(comp_ms, 3),
            "ring_over_compute": round(ring_ms / comp_ms, 4),
            "ring_rank_ms": [round(x, 3) for x in ring_ranks], "compute_rank_ms": [round(x, 3) for x in comp_ranks],
            "peak_kv_bytes_per_rank": rs.peak_kv_bytes, "full_kv_bytes": tokens * kv_bytes_per_token(),
            "bytes_sent_per_rank": rs.bytes_sent,
        }
        if with_ag:
            full = c.gather_full_kv(kv, plan, rank, None, c.GatherStats())
            ag = lambda: c.allgather_attention(q, kv, plan, rank, attn=attn, scale=scale, stats=gs)
            ag_comp = lambda: c.allgather_attention(q, kv, plan, rank, attn=attn, scale=scale, full_kv=full)
            gather = lambda: c.gather_full_kv(kv, plan, rank, None, c.GatherStats())
            ag_ms, _ = self.b.timed(ag, reps)
            agc_ms, _ = self.b.timed(ag_comp, reps)
            g_ms, _ = self.b.timed(gather, reps)
            coll_ms, _ = self.b.timed(_collective_only(kv), reps)
            del full
            pt.update({"allgather_ms": round(ag_ms, 3), "speedup": round(ag_ms / ring_ms, 4),
                       "allgather_peak_kv_bytes_per_rank": gs.peak_kv_bytes,
                       **split_fields(g_ms, coll_ms, agc_ms, ring_ms, ag_ms)})
            if tokens <= 131072:
                pt["max_abs_diff_ring_vs_allgather"] = _max_diff(ring()[0], ag()[0])
            if peaks:
                pt["measured_peak_extra_bytes_ring"] = self.b.peak(ring)
                pt["measured_peak_extra_bytes_allgather"] = self.b.peak(ag)
            self.log(f"[{case} {kernel}] {tokens} tok: all-gather {ag_ms:.2f} ms (gather {g_ms:.2f}, collective "
                     f"{coll_ms:.2f}, compute {agc_ms:.2f}) ring {ring_ms:.2f} compute-only {comp_ms:.2f} | "
                     f"ag/ring {ag_ms / ring_ms:.3f} ceiling {pt['overlap_ceiling']:.3f} ring/compute "
                     f"{ring_ms / comp_ms:.3f}")
        else:
            self.log(f"[{case} {kernel} {mode}] {tokens} tok: ring {ring_ms:.2f} ms compute-only {comp_ms:.2f} ms "
                     f"rank ms {pt['ring_rank_ms']}")
        del q, kv
        self.b.free()
        return pt

    def balance(self, kernel: str) -> None:
        tokens = self.args.balance_tokens
        for mode in ("zigzag", "contiguous"):
            pt = self.dense(kernel, tokens, mode=mode, case="load_balance", with_ag=False)
            pt["slowest_over_mean"] = round(max(pt["ring_rank_ms"]) / statistics.mean(pt["ring_rank_ms"]), 4)
            pt["compute_slowest_over_mean"] = round(
                max(pt["compute_rank_ms"]) / statistics.mean(pt["compute_rank_ms"]), 4)
            plan = self.core.ShardPlan.build([tokens], self.world, mode)
            work = [plan.causal_work(r) for r in range(self.world)]
            pt["work_slowest_over_mean"] = round(max(work) / statistics.mean(work), 4)
            self.log(f"[balance] {mode}: slowest/mean {pt['slowest_over_mean']} (compute-only "
                     f"{pt['compute_slowest_over_mean']}, causal work {pt['work_slowest_over_mean']})")
            self.add(pt)

    # ---------------------------------------------------------------- memory-bound batch
    def batch(self, kernel: str) -> None:
        c, rank, a = self.core, self.rank, self.args
        attn = c.select_block_attention(kernel)
        scale = 1.0 / math.sqrt(D)
        n_prompts, plen, nch = a.batch_prompts, a.batch_prompt_tokens, a.chunks
        per_prompt = plen * kv_bytes_per_token()
        budget = a.batch_budget_gib * 2**30
        # Per-rank K/V alive at once, per prompt: ring = own shard + two chunk buffers; all-gather =
        # own shard + gather buffer + the reordered full K/V (SGLang's materialize_full_kv).
        ring_per = per_prompt / self.world * (1 + 2 / nch)
        ag_per = per_prompt * (1 / self.world + 2)
        b_ring = max(1, min(n_prompts, int(budget // ring_per)))
        b_ag = max(1, min(n_prompts, int(budget // ag_per)))
        sizes = {b_ring, b_ag, n_prompts % b_ring or b_ring, n_prompts % b_ag or b_ag}
        plans = {n: c.ShardPlan.build([plen] * n, self.world, "zigzag") for n in sizes}
        inputs = {n: _dense_inputs(plans[n], rank, self.dev) for n in sizes}
        fulls: dict[int, list[torch.Tensor]] = {}

        def schedule(bsz: int) -> list[int]:
            return [min(bsz, n_prompts - lo) for lo in range(0, n_prompts, bsz)]

        def run(kind: str, bsz: int) -> None:
            for n in schedule(bsz):
                q, kv = inputs[n]
                if kind == "ring":
                    c.ring_attention(q, kv, plans[n], rank, attn=attn, scale=scale, chunks_per_shard=nch)
                elif kind == "compute":
                    c.ring_attention(q, kv, plans[n], rank, attn=attn, scale=scale, chunks_per_shard=nch, comm=False)
                elif kind == "ag":
                    c.allgather_attention(q, kv, plans[n], rank, attn=attn, scale=scale)
                elif kind == "ag_compute":
                    c.allgather_attention(q, kv, plans[n], rank, attn=attn, scale=scale, full_kv=fulls[n])
                else:  # gather only
                    c.gather_full_kv(kv, plans[n], rank, None, c.GatherStats())

        ring_ms, _ = self.b.timed(lambda: run("ring", b_ring), 2)
        comp_ms, _ = self.b.timed(lambda: run("compute", b_ring), 2)
        ag_ms, _ = self.b.timed(lambda: run("ag", b_ag), 2)
        for n in set(schedule(b_ag)):
            fulls[n] = c.gather_full_kv(inputs[n][1], plans[n], rank, None, c.GatherStats())
        agc_ms, _ = self.b.timed(lambda: run("ag_compute", b_ag), 2)
        g_ms, _ = self.b.timed(lambda: run("gather", b_ag), 2)
        colls = {n: _collective_only(inputs[n][1]) for n in set(schedule(b_ag))}
        coll_ms, _ = self.b.timed(lambda: [colls[n]() for n in schedule(b_ag)], 2)
        pt = {"case": "memory_bound_batch", "tokens": n_prompts * plen, "prompts": n_prompts, "prompt_tokens": plen,
              "budget_bytes_per_rank": budget, "ring_batch": b_ring, "allgather_batch": b_ag, "kernel": kernel,
              "chunks_per_shard": nch, "allgather_ms": round(ag_ms, 3), "ring_ms": round(ring_ms, 3),
              "compute_only_ms": round(comp_ms, 3), "speedup": round(ag_ms / ring_ms, 4),
              "ring_over_compute": round(ring_ms / comp_ms, 4),
              "peak_kv_bytes_per_rank": int(ring_per * b_ring), "allgather_peak_kv_bytes_per_rank": int(ag_per * b_ag),
              "full_kv_bytes": n_prompts * per_prompt, **split_fields(g_ms, coll_ms, agc_ms, ring_ms, ag_ms)}
        self.log(f"[batch {kernel}] {n_prompts}x{plen}, {a.batch_budget_gib} GiB: ring batch {b_ring} {ring_ms:.1f} ms "
                 f"(compute-only {comp_ms:.1f}), all-gather batch {b_ag} {ag_ms:.1f} ms (gather {g_ms:.1f}, "
                 f"collective {coll_ms:.1f}, compute {agc_ms:.1f}) | ag/ring {pt['speedup']:.3f} ceiling "
                 f"{pt['overlap_ceiling']:.3f}")
        self.add(pt)
        del inputs, fulls, colls
        self.b.free()

    # ---------------------------------------------------------------- sparse top-k
    def sparse(self, tokens: int, kernel: str, chunk_options: list[int], reps: int = 2) -> None:
        from kllm_plugins.plugins.ring_cp.core.sparse_topk import (
            GroupTables, allgather_sparse_attention, ring_sparse_attention,
        )

        c, rank, a = self.core, self.rank, self.args
        sh, sd = a.sparse_heads, a.sparse_dim
        scale = 1 / math.sqrt(sd)
        plan = c.ShardPlan.build([tokens], self.world, "zigzag")
        n = plan.local_len(rank)
        g = torch.Generator(device=self.dev).manual_seed(99 + rank)
        q = torch.randn(n, sh, sd, device=self.dev, dtype=torch.bfloat16, generator=g)
        lat = torch.randn(n, 1, sd, device=self.dev, dtype=torch.bfloat16, generator=g)
        pos = plan.global_index(rank, self.dev)
        # Stand-in indexer output: top-k positions at or before each query (uniform, with replacement).
        idx = torch.empty(n, a.topk, dtype=torch.int32, device=self.dev)
        for lo in range(0, n, 16384):
            hi = min(n, lo + 16384)
            r = torch.rand(hi - lo, a.topk, device=self.dev, generator=g)
            idx[lo:hi] = (r * (pos[lo:hi, None] + 1).float()).long().clamp(max=tokens - 1).to(torch.int32)
        full = c.gather_full_kv([lat], plan, rank, None, c.GatherStats())[0]
        cfg = None
        sweep: dict[str, float] = {}
        if kernel == "triton" and self.dev.type == "cuda":
            cfg, sweep = self._pick_sparse_config(q, full, idx, scale, sd)
        kw = dict(scale=scale, kernel=kernel, kernel_config=cfg, q_chunk=a.q_chunk)
        ag = lambda: allgather_sparse_attention(q, lat, idx, plan, rank, stats=gs, **kw)
        ag_comp = lambda: allgather_sparse_attention(q, lat, idx, plan, rank, full_latent=full, **kw)
        gs = c.GatherStats()
        by_chunks: dict[int, dict[str, float]] = {}
        rs_best = None
        for nch in chunk_options:
            tables = GroupTables.build(plan, rank, nch, self.dev)
            rs = c.RingStats()
            ring = lambda: ring_sparse_attention(q, lat, idx, plan, rank, chunks_per_shard=nch, stats=rs,
                                                 tables=tables, **kw)
            comp = lambda: ring_sparse_attention(q, lat, idx, plan, rank, chunks_per_shard=nch, comm=False,
                                                 tables=tables, **kw)
            r_ms, _ = self.b.timed(ring, reps)
            c_ms, _ = self.b.timed(comp, reps)
            by_chunks[nch] = {"ring_ms": round(r_ms, 3), "compute_only_ms": round(c_ms, 3),
                              "peak_kv_bytes_per_rank": rs.peak_kv_bytes}
            if rs_best is None or r_ms < by_chunks[rs_best]["ring_ms"]:
                rs_best = nch
        ag_ms, _ = self.b.timed(ag, reps)
        agc_ms, _ = self.b.timed(ag_comp, reps)
        variants = {"plain": round(ag_ms, 3)}
        if kernel == "triton" and a.sparse_key_blocks > 1:
            # The baseline may also walk its full latent in key blocks (cache locality); keep its best.
            kb = a.sparse_key_blocks
            agb = lambda: allgather_sparse_attention(q, lat, idx, plan, rank, key_blocks=kb, **kw)
            agb_ms, _ = self.b.timed(agb, reps)
            variants[f"key_blocks_{kb}"] = round(agb_ms, 3)
            if agb_ms < ag_ms:
                ag_comp = lambda: allgather_sparse_attention(q, lat, idx, plan, rank, full_latent=full,
                                                             key_blocks=kb, **kw)
                ag_ms = agb_ms
                agc_ms, _ = self.b.timed(ag_comp, reps)
        g_ms, _ = self.b.timed(lambda: c.gather_full_kv([lat], plan, rank, None, c.GatherStats()), reps)
        coll_ms, _ = self.b.timed(_collective_only([lat]), reps)
        best = by_chunks[rs_best]
        # Correctness on the device: the ring equals the all-gather; the kernel equals the torch reference.
        ring_out = ring_sparse_attention(q, lat, idx, plan, rank, chunks_per_shard=rs_best, **kw)[0]
        checks = {"max_abs_diff_ring_vs_allgather": _max_diff(ring_out, ag_comp()[0])}
        del ring_out
        if kernel == "triton":
            from kllm_plugins.plugins.ring_cp.core.sparse_topk import sparse_gather_attention

            m = min(n, 1024)
            ref = sparse_gather_attention(q[:m], full, idx[:m], scale, sd)[0]
            checks["max_abs_diff_kernel_vs_torch_1024_queries"] = _max_diff(ag_comp()[0][:m], ref)
        pt = {"case": "sparse_topk", "tokens": tokens, "topk": a.topk, "heads": sh, "latent_dim": sd,
              "kernel": kernel if kernel == "triton" else "torch_gather", "kernel_config": cfg,
              "config_sweep_allgather_compute_ms": sweep, "chunks_per_shard": rs_best,
              "ring_by_chunks": {str(k): v for k, v in by_chunks.items()},
              "allgather_variants_ms": variants, "allgather_ms": round(ag_ms, 3), "ring_ms": best["ring_ms"], "compute_only_ms": best["compute_only_ms"],
              "speedup": round(ag_ms / best["ring_ms"], 4),
              "ring_over_compute": round(best["ring_ms"] / best["compute_only_ms"], 4),
              "peak_kv_bytes_per_rank": best["peak_kv_bytes_per_rank"],
              "allgather_peak_kv_bytes_per_rank": gs.peak_kv_bytes, "full_kv_bytes": tokens * sd * 2,
              **split_fields(g_ms, coll_ms, agc_ms, best["ring_ms"], ag_ms), **checks}
        self.log(f"[sparse {kernel}] {tokens} tok top-{a.topk}: all-gather {ag_ms:.2f} ms (gather {g_ms:.2f}, "
                 f"collective {coll_ms:.2f}, compute {agc_ms:.2f}; variants {variants}); ring by chunks {by_chunks} | ag/ring "
                 f"{pt['speedup']:.3f} ceiling {pt['overlap_ceiling']:.3f} checks {checks}")
        self.add(pt)
        del q, lat, idx, full
        self.b.free()

    def _pick_sparse_config(self, q: torch.Tensor, full: torch.Tensor, idx: torch.Tensor, scale: float,
                            sd: int) -> tuple[int | None, dict[str, float]]:
        """Time each kernel config on the all-gather's compute (its best is then used by both sides)."""
        from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import CONFIGS, sparse_latent_attention

        times: dict[str, float] = {}
        for i, cfg in enumerate(CONFIGS):
            try:
                ms, _ = self.b.timed(lambda: sparse_latent_attention(q, full, idx, scale=scale, v_dim=sd, config=i), 1)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit this device
                self.log(f"sparse config {cfg} failed: {type(exc).__name__}")
                continue
            times[str(i)] = round(ms, 3)
        best = min(times, key=times.__getitem__) if times else None
        self.log(f"sparse kernel configs (all-gather compute ms): {times}; using {best}")
        return (int(best) if best is not None else None), times


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over all ranks."""
    d = (a.float() - b.float()).abs().max() if a.numel() else torch.zeros((), device=a.device)
    d = d.reshape(1).to(torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return round(float(d.item()), 6)


def _est_dense_s(tokens: int, kernel: str) -> float:
    per_call = (3.6 if kernel == "sdpa_flash" else 3.1) * (tokens / 524288) ** 2 + 0.02
    return per_call * (4 * 3 + 2 + 2) + 2


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, out_file: str) -> None:
    global H, HKV, D
    H, HKV, D = args.heads
    from kllm_plugins.hardware import get_adapter

    adapter = get_adapter()
    dev = torch.device("cpu")
    if adapter.device_type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    dist.init_process_group(adapter.collective_backend(), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)
    r = Runner(rank, world, args, dev, out_file)
    cases = args.cases

    def guard(what: str, fn: Any, *fa: Any, **fk: Any) -> None:
        # One failing case (e.g. a kernel that does not build on this device) must not cost the others.
        try:
            fn(*fa, **fk)
        except Exception:  # noqa: BLE001
            r.skipped.append(f"{what}: failed")
            print(f"rank {rank}: {what} failed:\n{traceback.format_exc()}", flush=True)
            r.b.free()

    if "sparse" in cases:
        for tokens in args.sparse_tokens:
            if r.budget(f"sparse {tokens}", 10 * tokens / 524288 + 4):
                guard(f"sparse {tokens}", r.sparse, tokens, args.sparse_kernel, args.sparse_chunks)
    if "batch" in cases:
        for kernel in args.kernels:
            if r.budget(f"batch {kernel}", 16):
                guard(f"batch {kernel}", r.batch, kernel)
    if "dense" in cases:
        for kernel in args.kernels:
            for tokens in args.tokens:
                if r.budget(f"dense {kernel} {tokens}", _est_dense_s(tokens, kernel)):
                    guard(f"dense {kernel} {tokens}", lambda: r.add(r.dense(kernel, tokens,
                                                                             peaks=kernel == args.kernels[0])))
    if "balance" in cases and r.budget("balance", 14):
        guard("balance", r.balance, args.kernels[0])
    if "sparse_torch" in cases:
        for tokens in args.sparse_torch_tokens:
            if r.budget(f"sparse torch {tokens}", 12 * tokens / 131072):
                guard(f"sparse torch {tokens}", r.sparse, tokens, "torch", [1], reps=1)
    r.log(f"done; skipped: {r.skipped}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cases", default="sparse,batch,dense,balance,sparse_torch")
    ap.add_argument("--kernels", nargs="+", default=["triton", "sdpa_flash"],
                    choices=["sdpa_flash", "triton", "torch"], help="dense block attention (same on both sides)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072, 262144, 524288])
    ap.add_argument("--chunks", type=int, default=4, help="chunks per shard on the dense ring")
    ap.add_argument("--balance-tokens", type=int, default=262144)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--batch-prompt-tokens", type=int, default=65536)
    ap.add_argument("--batch-budget-gib", type=float, default=2.0)
    ap.add_argument("--sparse-tokens", type=int, nargs="+", default=[131072, 262144, 524288])
    ap.add_argument("--sparse-torch-tokens", type=int, nargs="+", default=[131072])
    ap.add_argument("--sparse-kernel", default="triton", choices=["triton", "torch"])
    ap.add_argument("--sparse-chunks", type=int, nargs="+", default=[1, 4], help="ring chunks per shard to try")
    ap.add_argument("--sparse-key-blocks", type=int, default=8,
                    help="also time the all-gather walking its latent in this many key blocks (its best is kept)")
    ap.add_argument("--sparse-heads", type=int, default=16)
    ap.add_argument("--sparse-dim", type=int, default=512)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--q-chunk", type=int, default=1024, help="query block of the torch sparse path")
    ap.add_argument("--heads", type=int, nargs=3, default=[H, HKV, D], metavar=("H", "HKV", "D"))
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip cases that would end past this")
    ap.add_argument("--json", default="benchmarks/results/ring_cp.json")
    args = ap.parse_args()
    args.cases = set(args.cases.split(","))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    part = args.json + ".part"
    mp.spawn(_worker, args=(args.gpus, args, port, part), nprocs=args.gpus, join=True)
    body = json.loads(Path(part).read_text())
    command = "python " + " ".join(sys.argv)
    for p in body["points"]:
        p["command"] = command
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"command": command, "device": device, "torch": torch.__version__, **body}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    os.remove(part)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
