"""Benchmark helpers for ring_cp (imported by bench_ring.py; never collected by pytest).

Timing across ranks (the slowest rank's wall time, median over reps), peak-memory growth, the
all-gather's communication/compute split and the overlap ceiling it implies, and a time budget
that every rank agrees on (so a long run ends with what it has instead of being killed).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


class Bench:
    def __init__(self, dev: torch.device, deadline_s: float) -> None:
        self.dev = dev
        self.t0 = time.perf_counter()
        self.deadline_s = deadline_s

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def has_time(self, needed_s: float) -> bool:
        """Rank 0 decides whether `needed_s` more seconds fit the budget; every rank gets the same answer."""
        ok = torch.tensor([1.0 if self.elapsed() + needed_s <= self.deadline_s else 0.0], device=self.dev)
        dist.broadcast(ok, 0)
        return bool(ok.item())

    def timed(self, fn: Callable[[], Any], reps: int, warmup: int = 1) -> tuple[float, list[float]]:
        """(median over reps of the slowest rank's ms, each rank's median ms)."""
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        t = torch.tensor(times, device=self.dev)
        allt = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(allt, t)
        per_rank = [statistics.median(x.tolist()) for x in allt]
        slowest = torch.stack(allt).max(dim=0).values.tolist()
        return statistics.median(slowest), per_rank

    def peak(self, fn: Callable[[], Any]) -> int:
        """Growth of max_memory_allocated over one call, the largest over ranks (0 off CUDA)."""
        if self.dev.type != "cuda":
            return 0
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        t = torch.tensor([torch.cuda.max_memory_allocated() - base], device=self.dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def free(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def split_fields(gather_ms: float, collective_ms: float, compute_ms: float, ring_ms: float,
                 allgather_ms: float) -> dict[str, float]:
    """The all-gather's time split and the most any overlap of it could gain.

    ceiling = (t_comm + t_compute) / max(t_comm, t_compute): a ring that moved the same bytes
    and ran the same compute, hiding all of one behind the other, can be at most that much
    faster. t_comm is the whole gather step (collective, padding, reorder into sequence order).
    """
    ceiling = (gather_ms + compute_ms) / max(gather_ms, compute_ms, 1e-9)
    speedup = allgather_ms / ring_ms
    return {
        "allgather_comm_ms": round(gather_ms, 3),
        "allgather_collective_ms": round(collective_ms, 3),
        "allgather_compute_ms": round(compute_ms, 3),
        "overlap_ceiling": round(ceiling, 4),
        "speedup_over_ceiling": round(speedup / ceiling, 4),
    }
