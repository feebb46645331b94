"""L3 page reads and writes as HiCache runs them, per page: stock HiCache's `file` backend against the
plugin's file store, through HiCache's own storage functions (no server; CPU, local disk, page cache
warm).

HiCache moves pages between its host pool and a storage backend in one of two ways
(`HiCacheController`): the generic path (`_generic_page_get`: a zeroed flat page per key, the
backend reads into it, then a copy into the pool; `_generic_page_set`: a flattening copy of each pool
page, then the backend writes it), which SGLang's `file` backend gets, and the zero-copy path
(`_page_get_zero_copy` / `_page_set_zero_copy`: the backend gets host indices), which a `dynamic`
backend gets with `interface_v1`. The plugin's backend takes the zero-copy path by default and moves a
page's bytes straight between the pool and the file (one `readv` / `writev` over the page's blocks in
the pool). Setups:

- `stock`: SGLang's `HiCacheFile` on the generic path (what `--hicache-storage-backend file` does);
- `kv_tiers_staged`: the plugin's backend on the generic path (`interface_v1` 0);
- `kv_tiers`: the plugin's backend on the zero-copy path (its default).

The functions called are HiCache's own (`HiCacheController._generic_page_get` and the others, run
unbound on an object that holds what they read), the host pool is SGLang's `MHATokenToKVPoolHost`
page methods over a random buffer (`kllm_plugins.plugins.kv_tiers.testing.mha_host_pool`). Each round writes
`--pages` fresh pages per setup in batches of `--batch` (HiCache's storage batch), then reads them
back into other pool pages and checks the bytes; setups run in rotating order within a round.
Prints median microseconds per page, read and write, and the ratios against stock; `--record`
writes benchmarks/results/kv_tiers/<--results-name>.json through the harness's recorder.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kllm_plugins.bench import stats
from kllm_plugins.bench.record import record as write_record

ROOT = Path(__file__).resolve().parents[2]
SETUPS = ("stock", "kv_tiers_staged", "kv_tiers")
# (layers, heads, head_dim): the tiny Llama of the CPU benchmarks, and an 8B-class model's KV head shape
SHAPES = {"tiny": (4, 2, 64), "8b": (32, 8, 128)}


class _Op:
    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


def _config(extra: dict[str, Any] | None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="bench-model", extra_config=extra,
    )


def _backend(setup: str, pool: Any, folder: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import file_storage, state

    if setup == "stock":
        b = HiCacheFile(_config({}), file_path=folder)
    else:
        state._tiers = None
        extra = {"store_dir": folder, "interface_v1": 1 if setup == "kv_tiers" else 0,
                 "write_all_below_pressure": True, "min_reuse": 1}
        b = file_storage.KllmFileStorage(_config(extra), {})
        b.t.persistence.dormant = lambda: False  # as in a workload with reuse: every page written
    b.register_mem_pool_host(pool)
    return b


def _controller(setup: str, backend: Any, pool: Any) -> Any:
    from sglang.srt.managers.cache_controller import HiCacheController as C

    ctl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                          page_size=pool.page_size)
    if setup == "kv_tiers":
        ctl.get = lambda keys, idx: C._page_get_zero_copy(ctl, _Op(), keys, idx, None)
        ctl.set = lambda keys, idx: C._page_set_zero_copy(ctl, keys, idx, None)
    else:
        ctl.get = lambda keys, idx: C._generic_page_get(ctl, _Op(), keys, idx, None)
        ctl.set = lambda keys, idx: C._generic_page_set(ctl, keys, idx, None)
    return ctl


def _indices(pages: list[int], ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


def one_round(ctl: Any, pool: Any, n: int, batch: int, tag: str) -> dict[str, float]:
    ps = pool.page_size
    src = list(range(n))
    dst = list(range(n, 2 * n))
    keys = [f"{tag}-{i:06d}" for i in src]
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        assert ctl.set(keys[i : i + batch], _indices(src[i : i + batch], ps)) is not False
    t1 = time.perf_counter()
    got = 0
    for i in range(0, n, batch):
        got += ctl.get(keys[i : i + batch], _indices(dst[i : i + batch], ps))
    t2 = time.perf_counter()
    if got != n:
        raise RuntimeError(f"{tag}: {got} of {n} pages read back")
    for s, d in zip(src[:: max(1, n // 16)], dst[:: max(1, n // 16)]):
        if not torch.equal(pool.get_data_page(s * ps), pool.get_data_page(d * ps)):
            raise RuntimeError(f"{tag}: page {s} read back differs")
    return {"write_us": (t1 - t0) / n * 1e6, "read_us": (t2 - t1) / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="layer_first,page_first_direct")
    ap.add_argument("--shapes", default="tiny,8b")
    ap.add_argument("--pages", type=int, default=256, help="pages written and read per setup and round "
                    "(at most --max-mib of them)")
    ap.add_argument("--max-mib", type=float, default=64.0, help="bound on the bytes of those pages")
    ap.add_argument("--batch", type=int, default=128, help="pages per backend call (HiCache's storage batch)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="", help="folder for the stores (default: a temporary one on local disk)")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results-name", default="page_io", help="benchmarks/results/kv_tiers/<name>.json")
    ap.add_argument("--results-root", default=str(ROOT), help="write results under this folder (smoke runs)")
    args = ap.parse_args()
    command = "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT) if Path(sys.argv[0]).is_absolute()
                                         else sys.argv[0])] + sys.argv[1:])
    from kllm_plugins.plugins.kv_tiers.testing import mha_host_pool

    base = args.dir or tempfile.mkdtemp(prefix="kllm-page-io-", dir=os.environ.get("KLLM_BENCH_DIR"))
    recs: list[dict[str, Any]] = []
    try:
        for shape in args.shapes.split(","):
            layers, heads, dim = SHAPES[shape]
            page_bytes = 2 * layers * 16 * heads * dim * 2
            n = max(1, min(args.pages, int(args.max_mib * (1 << 20) // page_bytes)))
            for layout in args.layouts.split(","):
                pool = mha_host_pool(layout, 2 * n, layers=layers, heads=heads, head_dim=dim)
                ctls = {}
                for s in SETUPS:
                    folder = os.path.join(base, f"{shape}-{layout}-{s}")
                    ctls[s] = _controller(s, _backend(s, pool, folder), pool)
                for r in range(args.rounds):
                    order = SETUPS[r % 3:] + SETUPS[: r % 3]
                    for s in order:
                        m = one_round(ctls[s], pool, n, args.batch, f"{s}-{r}")
                        recs.append({"shape": shape, "layout": layout, "setup": s, "round": r, **m})
                page_kib = pool.get_dummy_flat_data_page().numel() * 2 / 1024
                print(f"== {shape} {layout}: {n} pages of {page_kib:.0f} KiB done", file=sys.stderr, flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    table = summarize(recs)
    print(table)
    if args.record:
        res = write_record("kv_tiers", args.results_name, command, metrics(recs),
                           root=Path(args.results_root),
                           shared="shared 2-core, several helpers; benchmarks under flock", records=recs)
        print(f"recorded {res}")


def metrics(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per page shape, layout and operation: each setup's us per page as a spread over rounds and the
    ratio of medians against stock (paired by round: the setups of a round run back to back)."""
    out: dict[str, Any] = {}
    for shape, layout in sorted({(r["shape"], r["layout"]) for r in recs}):
        for op in ("read_us", "write_us"):
            per = {s: [r[op] for r in sorted(recs, key=lambda r: r["round"])
                       if (r["shape"], r["layout"], r["setup"]) == (shape, layout, s)] for s in SETUPS}
            cell: dict[str, Any] = {s: {k: v for k, v in stats.spread(xs).items() if k != "repeats"}
                                    for s, xs in per.items() if xs}
            for s in SETUPS:
                if s != "stock" and per[s] and per["stock"]:
                    cell[f"{s}_vs_stock"] = stats.ratio_of_medians(per[s], per["stock"])
            out[f"{shape}.{layout}.{op[:-3]}"] = cell
    return out


def summarize(recs: list[dict[str, Any]]) -> str:
    lines = ["| shape (page) | layout | op | stock us | kv_tiers_staged us | kv_tiers us | staged / stock | kv_tiers / stock |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    combos = sorted({(r["shape"], r["layout"]) for r in recs}, key=lambda c: (list(SHAPES).index(c[0]), c[1]))
    for shape, layout in combos:
        for op in ("read_us", "write_us"):
            med = {s: stats.quantile([r[op] for r in recs if (r["shape"], r["layout"], r["setup"]) == (shape, layout, s)], 0.5)
                   for s in SETUPS}
            lines.append(f"| {shape} | {layout} | {op[:-3]} | {med['stock']:.1f} | {med['kv_tiers_staged']:.1f} | "
                         f"{med['kv_tiers']:.1f} | {med['kv_tiers_staged'] / med['stock']:.2f}x | "
                         f"{med['kv_tiers'] / med['stock']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
