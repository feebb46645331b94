"""L1 <-> L2 copy bandwidth of scattered KV pages: our staged, double-buffered path against a
plain `tensor.copy_` per page and against one contiguous copy (the PCIe limit), pinned and
pageable host memory, page-first and layer-first device layouts. Needs CUDA for real figures
(`--device cpu --pages 64` checks the logic only).

    python benchmarks/kv_tiers/bench_copy_gpu.py [--pages 8192 --page-kib 32 --out result.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from plugins.kv_tiers.core.staged_copy import LayerListCopier, StagedCopier  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], None], dev: torch.device, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--page-kib", type=int, default=32)
    ap.add_argument("--pool-factor", type=int, default=2, help="device pool pages = factor x pages")
    ap.add_argument("--layers", type=int, default=32, help="layers of the layer-first pool")
    ap.add_argument("--chunks", default="256,1024,2048", help="staging chunk sizes (pages) to try")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sglang-layout", action="store_true",
                    help="also the path hooked into HiCache: SGLang's per-layer device tensors <-> page_first_direct "
                         "host pool (LayerListCopier), against a copy per page and layer")
    ap.add_argument("--page-tokens", type=int, default=16, help="tokens per page (SGLang layout)")
    ap.add_argument("--hooked-chunks", default="32,64,256", help="chunk sizes (pages) of the hooked path")
    ap.add_argument("--only-sglang", action="store_true",
                    help="skip the standalone staged rows (the limit and the per-page baseline are kept)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16
    elems = a.page_kib * 1024 // dtype.itemsize
    n, pool_pages = a.pages, a.pages * a.pool_factor
    nbytes = n * elems * dtype.itemsize
    pin = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    pages = torch.randperm(pool_pages, generator=g)[:n].to(dev)  # scattered, no two alike
    pool_pf = torch.randn(pool_pages, elems, device=dev).to(dtype)
    pool_lf = torch.randn(a.layers, pool_pages, elems // a.layers, device=dev).to(dtype)
    host_pinned = torch.empty(n, elems, dtype=dtype, pin_memory=pin)
    host_pageable = torch.empty(n, elems, dtype=dtype)
    contig = torch.empty(n, elems, dtype=dtype, device=dev)
    rows: list[dict[str, object]] = []

    def record(name: str, direction: str, host: str, layout: str, times: list[float]) -> None:
        med = statistics.median(times)
        rows.append({"path": name, "direction": direction, "host": host, "layout": layout,
                     "median_s": med, "gbps": nbytes / med / 1e9,
                     "spread_gbps": [nbytes / max(times) / 1e9, nbytes / min(times) / 1e9]})

    # the PCIe limit: one contiguous copy
    for host, h in (("pinned", host_pinned), ("pageable", host_pageable)):
        record("contiguous_copy", "d2h", host, "-", timed(lambda: h.copy_(contig, non_blocking=True), dev, a.reps))
        record("contiguous_copy", "h2d", host, "-", timed(lambda: contig.copy_(h, non_blocking=True), dev, a.reps))

    idx_list = pages.tolist()

    # baseline: a plain tensor.copy_ per page (page-first pool)
    def per_page_d2h(h: torch.Tensor) -> None:
        for i, p in enumerate(idx_list):
            h[i].copy_(pool_pf[p], non_blocking=True)

    def per_page_h2d(h: torch.Tensor) -> None:
        for i, p in enumerate(idx_list):
            pool_pf[p].copy_(h[i], non_blocking=True)

    record("per_page_copy", "d2h", "pinned", "page_first", timed(lambda: per_page_d2h(host_pinned), dev, 3, 1))
    record("per_page_copy", "h2d", "pinned", "page_first", timed(lambda: per_page_h2d(host_pinned), dev, 3, 1))

    # gather on the device, then one copy (not overlapped)
    def gather_once() -> None:
        torch.index_select(pool_pf, 0, pages, out=contig)
        host_pinned.copy_(contig, non_blocking=True)

    record("gather_then_copy", "d2h", "pinned", "page_first", timed(gather_once, dev, a.reps))

    # ours: staged, double-buffered
    for chunk in ([] if a.only_sglang else [int(c) for c in a.chunks.split(",")]):
        cp = StagedCopier(dev, elems, dtype, chunk_pages=chunk, num_buffers=2)
        for layout, pool in (("page_first", pool_pf), ("layer_first", pool_lf)):
            for host, h in (("pinned", host_pinned), ("pageable", host_pageable)):
                if host == "pageable" and (layout == "layer_first" or chunk != 1024):
                    continue
                record(f"staged_c{chunk}", "d2h", host, layout,
                       timed(lambda: cp.to_host(pool, layout, pages, h), dev, a.reps))
                record(f"staged_c{chunk}", "h2d", host, layout,
                       timed(lambda: cp.to_device(h, pool, layout, pages), dev, a.reps))

    if a.sglang_layout:
        ok_sg = sglang_layout(a, dev, dtype, nbytes, host_pinned, timed_record=record)
    else:
        ok_sg = True

    # correctness of the measured path, both layouts, both directions
    cp = StagedCopier(dev, elems, dtype, chunk_pages=1024)
    ok = True
    for layout, pool in (("page_first", pool_pf), ("layer_first", pool_lf)):
        cp.to_host(pool, layout, pages, host_pinned)
        ref = pool[pages] if layout == "page_first" else pool[:, pages].transpose(0, 1).reshape(n, elems)
        ok &= torch.equal(host_pinned.to(dev), ref)
        host_pinned.copy_(torch.randn(n, elems).to(dtype))
        cp.to_device(host_pinned, pool, layout, pages)
        got = pool[pages] if layout == "page_first" else pool[:, pages].transpose(0, 1).reshape(n, elems)
        ok &= torch.equal(got.cpu(), host_pinned)

    limit = {d: next(r["gbps"] for r in rows if r["path"] == "contiguous_copy" and r["host"] == "pinned"
                     and r["direction"] == d) for d in ("d2h", "h2d")}
    print(f"{n} pages x {a.page_kib} KiB = {nbytes / 2**20:.0f} MiB, device {torch.cuda.get_device_name(dev) if pin else dev}")
    print(f"{'path':<18}{'dir':<5}{'host':<10}{'layout':<13}{'GB/s':>8}{'of pinned contiguous':>22}")
    for r in rows:
        frac = r["gbps"] / limit[r["direction"]]
        print(f"{r['path']:<18}{r['direction']:<5}{r['host']:<10}{r['layout']:<13}{r['gbps']:>8.2f}{frac:>21.1%}")
    best = {}
    for d in ("d2h", "h2d"):
        for layout, prefix in (("page_first", "staged"), ("layer_first", "staged"),
                               ("sglang_page_first_direct", "hooked_torch"),
                               ("sglang_page_first_direct", "hooked_triton")):
            cands = [r for r in rows if r["path"].startswith(prefix) and r["host"] == "pinned"
                     and r["direction"] == d and r["layout"] == layout]
            if cands:
                top = max(cands, key=lambda r: r["gbps"])
                key = f"{d}_{layout}" if prefix == "staged" else f"{d}_{prefix}"
                best[key] = {"path": top["path"], "gbps": top["gbps"], "of_limit": top["gbps"] / limit[d]}
        if f"{d}_hooked_torch" in best and f"{d}_hooked_triton" in best:
            print(f"hooked {d}: old (torch per layer) {best[f'{d}_hooked_torch']['gbps']:.2f} GB/s "
                  f"({best[f'{d}_hooked_torch']['of_limit']:.1%}), new (triton) {best[f'{d}_hooked_triton']['gbps']:.2f} "
                  f"GB/s ({best[f'{d}_hooked_triton']['of_limit']:.1%}), new/old "
                  f"{best[f'{d}_hooked_triton']['gbps'] / best[f'{d}_hooked_torch']['gbps']:.3f}x")
    print("best staged (pinned):", json.dumps(best))
    ok &= ok_sg
    print("correct:", ok)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "pages": n, "page_kib": a.page_kib,
                                           "device": torch.cuda.get_device_name(dev) if pin else str(dev),
                                           "torch": torch.__version__, "limit_gbps": limit, "best_staged": best,
                                           "correct": ok, "rows": rows}, indent=1))


def sglang_layout(a: argparse.Namespace, dev: torch.device, dtype: torch.dtype, nbytes: int,
                  host_like: torch.Tensor, timed_record: Callable[..., None]) -> bool:
    """The hooked path on SGLang's buffers, one K pool: `a.layers` device tensors [rows, 8 heads, dim],
    host [pages, layers, page_tokens, 8, dim] (pinned), the same bytes as the other rows. Device
    pages scattered; host pages in runs of 64 (HiCache's allocator hands out mostly consecutive
    pages). Baseline: a `copy_` per page and layer (what a naive direct transfer issues)."""
    heads, ps, L = 8, a.page_tokens, a.layers
    dim = max(1, a.page_kib * 1024 // dtype.itemsize // (ps * heads))  # a layer's page = --page-kib
    page_bytes = L * ps * heads * dim * dtype.itemsize
    n = max(1, nbytes // page_bytes)
    dev_pages_total, host_pages_total = 2 * n, 2 * 64 * ((n + 63) // 64)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(dev_pages_total * ps + ps, heads, dim, device=dev).to(dtype) for _ in range(L)]
    host = torch.empty(host_pages_total, L, ps, heads, dim, dtype=dtype, pin_memory=dev.type == "cuda")
    dp = torch.randperm(dev_pages_total, generator=g)[:n].to(dev)
    starts = torch.randperm(host_pages_total // 64, generator=g)[: (n + 63) // 64] * 64
    hp = (starts[:, None] + torch.arange(64)).reshape(-1)[:n]
    moved = n * page_bytes
    scale = nbytes / moved  # report GB/s of the bytes actually moved

    def rec(name: str, d: str, times: list[float]) -> None:
        timed_record(name, d, "pinned", "sglang_page_first_direct", [t * scale for t in times])

    dl, hl = dp.tolist(), hp.tolist()

    def per_page_layer_d2h() -> None:
        for i, (p, h) in enumerate(zip(dl, hl)):
            for k in range(L):
                host[h, k].copy_(layers[k][p * ps:(p + 1) * ps], non_blocking=True)

    rec("per_page_layer_copy", "d2h", timed(per_page_layer_d2h, dev, 3, 1))
    kernels = ("torch", "triton") if dev.type == "cuda" else ("torch",)
    # old (torch: two kernels per layer and chunk) and new (triton: one launch per chunk), interleaved
    # per chunk size so drift in the machine's state touches both alike
    for chunk in [int(c) for c in a.hooked_chunks.split(",")]:
        for kernel in kernels:
            cp = LayerListCopier(dev, L, ps * heads * dim, dtype, chunk_pages=chunk, kernel=kernel)
            rec(f"hooked_{kernel}_c{chunk}", "d2h", timed(lambda: cp.to_host(layers, host, dp, hp, ps), dev, a.reps))
            rec(f"hooked_{kernel}_c{chunk}", "h2d", timed(lambda: cp.to_device(host, hp, layers, dp, ps), dev, a.reps))
    ok = True
    rows_of = (lambda pg: (pg[:, None] * ps + torch.arange(ps, device=dev)).reshape(-1))
    for kernel in kernels:
        cp = LayerListCopier(dev, L, ps * heads * dim, dtype, chunk_pages=64, kernel=kernel)
        host[hp] = 0
        cp.to_host(layers, host, dp, hp, ps)
        want = torch.stack([x[rows_of(dp)].view(n, ps, heads, dim) for x in layers], dim=1).cpu()
        ok_k = torch.equal(host[hp], want)
        host[hp] = torch.randn(n, L, ps, heads, dim).to(dtype)
        target = torch.randperm(dev_pages_total, generator=g)[:n].to(dev)
        cp.to_device(host, hp, layers, target, ps)
        got = torch.stack([x[rows_of(target)].view(n, ps, heads, dim) for x in layers], dim=1).cpu()
        ok_k &= torch.equal(got, host[hp])
        print(f"sglang layout, {kernel}: {n} pages x {L} layers x {ps} tokens x {heads} heads x {dim} dim = "
              f"{moved / 2**20:.0f} MiB, correct {ok_k}")
        ok &= ok_k
    return ok


if __name__ == "__main__":
    main()
