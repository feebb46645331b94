"""L1 -> L2 backup bandwidth of the hooked path (LayerListCopier: SGLang's per-layer device KV
tensors to HiCache's `page_first_direct` host pool) while other work holds the GPU, timed by CUDA
events as the server times it (`l2_backup_device` in bench_tiers: from the call's start on the
writing stream to its copies' end). Why: inside a serving server the same copy measured 57-89% of
the pinned PCIe limit, against 98% on an idle GPU.

Conditions, each `--reps` backup calls of one prompt's pages (K and V, every layer):
    idle            nothing else on the GPU;
    gemm            bf16 GEMMs queued on another stream of the same process (a forward overlapping
                    the backup, as under SGLang's overlap scheduler), gather at the default priority;
    gemm_high       the same, the copier's gather on a high-priority stream of its own;
    other_gemm      a second process running GEMMs (the bench's other server prefilling: two CUDA
                    contexts on one GPU are time-sliced without MPS);
    other_copy      a second process making the same backups (both servers writing to L2 at once:
                    one PCIe link);
    shuffled        idle, the host pages one consecutive range handed over in shuffled order (as a
                    free list can), the copier merging them back into runs (`host_order`);
    shuffled_as_is  the same pages copied in the order given (one copy per page: the old path);
    scattered       idle, host pages drawn at random from four times as many (little to merge);
    registered      idle, the host pool allocated as SGLang allocates it on CUDA (a plain tensor, then
                    cudaHostRegister: 4 KiB pages) instead of torch's pinned allocator;
    registered_thp  the same on memory advised to transparent huge pages before registering.

    python benchmarks/kv_tiers/copy_under_compute_gpu.py [--tokens 8704 --reps 10 --out F.json]
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plugins.kv_tiers.core.staged_copy import LayerListCopier  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16  # the 8B shape of the GPU benches, 16-token pages
CONDITIONS = ("idle", "gemm", "gemm_high", "other_gemm", "other_copy", "shuffled", "shuffled_as_is", "scattered",
              "registered", "registered_thp")


def host_tensor(shape: tuple[int, ...], how: str) -> torch.Tensor:
    """A bf16 host tensor: torch's pinned allocator ("pinned"), or SGLang's CUDA host pool recipe
    ("registered": allocate, then cudaHostRegister), optionally on memory advised to huge pages."""
    if how == "pinned":
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    n = 2 * math.prod(shape)
    if how == "registered_thp":
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(buf, dtype=torch.bfloat16).view(shape)
        _KEEP.append(buf)
    else:
        t = torch.empty(shape, dtype=torch.bfloat16)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    return t


_KEEP: list[Any] = []


def machine_memory() -> dict[str, Any]:
    """NUMA nodes, the GPU's node and the transparent huge page setting (what the copy's host side sits on)."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    try:  # nvidia-smi says 00000000:1B:00.0, sysfs 0000:1b:00.0
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()[-12:].lower()
    except (OSError, subprocess.SubprocessError):
        bus = ""
    return {"numa_nodes": {n: read(f"/sys/devices/system/node/{n}/cpulist") for n in nodes},
            "gpu_numa_node": read(f"/sys/bus/pci/devices/{str(bus).lower()}/numa_node") if bus else "",
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "cpus_allowed": len(os.sched_getaffinity(0))}


class Pools:
    """K and V device layers and the pinned host pool of one backup's worth of pages (x2)."""

    def __init__(self, tokens: int, dev: torch.device, seed: int = 0, host: str = "pinned") -> None:
        self.pages = tokens // PAGE
        rows = 4 * self.pages * PAGE + PAGE
        g = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(rows, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.v = [torch.randn(rows, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        shape = (4 * self.pages, LAYERS, PAGE, HEADS, DIM)
        self.hk, self.hv = host_tensor(shape, host), host_tensor(shape, host)
        # device pages scattered as a radix tree's free list leaves them; host pages consecutive
        self.dp = torch.randperm(4 * self.pages, generator=g)[: self.pages].to(dev)
        self.hp = torch.arange(self.pages) + self.pages
        self.host_pages = {"runs": self.hp, "shuffled": self.hp[torch.randperm(self.pages, generator=g)],
                           "scattered": torch.randperm(4 * self.pages, generator=g)[: self.pages]}
        self.nbytes = 2 * self.pages * LAYERS * PAGE * HEADS * DIM * 2

    def backup(self, cp: LayerListCopier, host: str = "runs") -> None:
        hp = self.host_pages[host]
        cp.to_host(self.k, self.hk, self.dp, hp, PAGE, sync=False)
        cp.to_host(self.v, self.hv, self.dp, hp, PAGE, sync=False)


def timed_backups(pools: Pools, cp: LayerListCopier, stream: torch.cuda.Stream, reps: int,
                  host: str = "runs") -> list[float]:
    """Device seconds of each backup, start and end events on the writing stream (as the server)."""
    out = []
    for _ in range(reps):
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pools.backup(cp, host)
            end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


class GemmLoad:
    """bf16 GEMMs queued on a stream of their own (a forward overlapping the backup)."""

    def __init__(self, n: int, dev: torch.device) -> None:
        self.stream = torch.cuda.Stream()
        self.a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        with torch.cuda.stream(self.stream):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self.a @ self.a
            e.record()
        e.synchronize()
        self.per_s = max(s.elapsed_time(e) / 1e3, 1e-4)

    def queue(self, seconds: float) -> None:
        """About `seconds` of device time (returns at once)."""
        with torch.cuda.stream(self.stream):
            for _ in range(int(seconds / self.per_s) + 1):
                self.a @ self.a


def _other(kind: str, tokens: int, ready: Any, stop: Any) -> None:
    """The second process: GEMMs or backups until told to stop."""
    dev = torch.device("cuda")
    st = torch.cuda.Stream()
    if kind == "other_copy":
        pools, cp = Pools(tokens, dev, seed=1), LayerListCopier(dev, LAYERS, PAGE * HEADS * DIM, torch.bfloat16)
        timed_backups(pools, cp, st, 2)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ready.set()
    while not stop.is_set():
        if kind == "other_copy":
            timed_backups(pools, cp, st, 1)
        else:
            with torch.cuda.stream(st):
                for _ in range(8):
                    a @ a
            st.synchronize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    pools = Pools(args.tokens, dev)
    cps = {p: LayerListCopier(dev, LAYERS, PAGE * HEADS * DIM, torch.bfloat16, chunk_pages=args.chunk_pages,
                              gather_priority=p) for p in (0, -1)}
    as_is = LayerListCopier(dev, LAYERS, PAGE * HEADS * DIM, torch.bfloat16, chunk_pages=args.chunk_pages,
                            merge_host_runs=False)
    other_pools = {h: Pools(args.tokens, dev, host=h) for h in ("registered", "registered_thp")
                   if h in args.conditions}
    write = torch.cuda.Stream()
    gemm = GemmLoad(args.gemm_n, dev)
    for cp in (*cps.values(), as_is):
        timed_backups(pools, cp, write, 2)
    for other in other_pools.values():
        timed_backups(other, cps[0], write, 2)
    # the PCIe limit: one contiguous pinned copy of the same bytes
    contig = torch.empty(pools.nbytes // 2, dtype=torch.bfloat16, device=dev)
    host = torch.empty(pools.nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    lim = []
    for _ in range(args.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        host.copy_(contig, non_blocking=True)
        e.record()
        e.synchronize()
        lim.append(pools.nbytes / (s.elapsed_time(e) / 1e3) / 1e9)
    ctx = mp.get_context("spawn")
    rows: dict[str, list[float]] = {c: [] for c in args.conditions}
    for rnd in range(args.rounds):  # conditions interleaved, order reversed every round
        order = list(args.conditions) if rnd % 2 == 0 else list(reversed(args.conditions))
        for cond in order:
            proc = None
            if cond.startswith("other"):
                ready, stop = ctx.Event(), ctx.Event()
                proc = ctx.Process(target=_other, args=(cond, args.tokens, ready, stop))
                proc.start()
                ready.wait(120)
            try:
                times = []
                for _ in range(args.reps):
                    if cond.startswith("gemm"):
                        gemm.queue(0.05)  # a forward's worth, queued first
                    cp = as_is if cond == "shuffled_as_is" else cps[-1 if cond == "gemm_high" else 0]
                    host = {"shuffled_as_is": "shuffled"}.get(cond, cond if cond in pools.host_pages else "runs")
                    times += timed_backups(other_pools.get(cond, pools), cp, write, 1, host)
                    torch.cuda.synchronize()
                rows[cond] += [pools.nbytes / t / 1e9 for t in times]
            finally:
                if proc is not None:
                    stop.set()
                    proc.join(60)
    limit = statistics.median(lim)
    summary = {c: {"median_gbps": round(statistics.median(v), 2), "min_gbps": round(min(v), 2),
                   "max_gbps": round(max(v), 2), "of_limit": round(statistics.median(v) / limit, 3), "n": len(v)}
               for c, v in rows.items()}
    return {"memory": machine_memory(), "limit_gbps": round(limit, 2), "backup_bytes": pools.nbytes, "conditions": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8704, help="tokens per backup (the no-reuse trace's prompt)")
    ap.add_argument("--chunk-pages", type=int, default=64, help="the plugin's staged_copier_chunk_pages")
    ap.add_argument("--reps", type=int, default=10, help="backups per condition and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("copy_under_compute_gpu: needs a CUDA device")
    t0 = time.perf_counter()
    res = run(a)
    res.update({"command": "python benchmarks/kv_tiers/copy_under_compute_gpu.py " + " ".join(sys.argv[1:]),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "seconds": round(time.perf_counter() - t0, 1)})
    print("host memory:", json.dumps(res["memory"]))
    print(f"pinned contiguous limit {res['limit_gbps']} GB/s; backup {res['backup_bytes'] / 2**20:.0f} MiB")
    print(f"{'condition':<12}{'GB/s':>8}{'min':>8}{'max':>8}{'of limit':>10}")
    for c, r in res["conditions"].items():
        print(f"{c:<12}{r['median_gbps']:>8.2f}{r['min_gbps']:>8.2f}{r['max_gbps']:>8.2f}{r['of_limit']:>10.1%}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
