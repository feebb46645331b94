"""Benchmark helper (GPU machine): can a spawned process read a CUDA tensor of its parent (CUDA IPC)?
`scripts/gpu/dspark_device_run.sh stage` runs it; the pipeline falls back to one feature cache per trainer (on a
capped share of the data) when it cannot.

    python benchmarks/dspark/ipc_check.py   # prints IPC ok / IPC failed
"""
from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp


def _child(x: torch.Tensor, q) -> None:
    q.put(float(x.float().sum()))


def main() -> int:
    if not torch.cuda.is_available():
        print("IPC skipped: no CUDA")
        return 0
    x = torch.arange(1000, device="cuda", dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(x, q))
    p.start()
    try:
        got = q.get(timeout=60)
    except Exception as e:  # noqa: BLE001 - any failure means: do not share
        print("IPC failed:", repr(e))
        return 1
    p.join()
    ok = abs(got - float(x.float().sum())) < 1e-3 and p.exitcode == 0
    print("IPC ok" if ok else f"IPC failed: {got}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
