"""How long kv_tiers' L3 write path keeps the scheduler's thread from running (CPU, no server).

HiCache calls the storage backend's `batch_set_v1` on a thread of the scheduler's process, so
whatever that call does while holding the GIL, the scheduler's thread waits for. On the H100 the
no-reuse control (nothing is ever read back) lost ~9% of L1 only's saturated throughput whether the
plugin wrote to L3 or not, and the write path's time went to the pages held while dormant: each
skipped page copied with `b"".join` (GIL held) and a long prompt's hundreds of pages copied into a
buffer that keeps tens. This benchmark replays that call with an 8B model's page (2 MiB) and
measures a stand-in for the scheduler's thread: a loop of short pure-Python steps on the main
thread, timed while a background thread makes the write calls back to back. The loop's time
stalled is the sum of each step's excess over twice the run's median step (steps that waited for
the GIL or lost the CPU), per write call.

Setups, interleaved per repeat:
  idle      no writer (the loop alone)
  before    the dormant hold as it was: every skipped page copied (`b"".join`) and held in turn
  kv_tiers  the current write path (`write_pages` with `FileBatch`): the buffer's tail only, copied
            by torch with the GIL released

    python benchmarks/kv_tiers/write_path_gil.py [--pages 544 --calls 6 --repeats 5] [--record]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kllm_plugins.bench import stats
from kllm_plugins.bench.record import record as write_record
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.plugins.kv_tiers.core import write_path
from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierMeter, TierState
from kllm_plugins.plugins.kv_tiers.sglang_adapter.file_storage import _FileBatch, _FileWriter

PAGE = 2 << 20  # bytes of one 16-token page of an 8B model (32 layers x 8 KV heads x 128 x K,V x bf16)
BLOCKS = 32  # a page_first host pool hands a page over in blocks (one per layer here)
SETUPS = ("idle", "before", "kv_tiers")


def hold_before(held: Any, keys: list[str], batch: Any, start: int) -> int:
    """The dormant hold before this change: every skipped page copied and held in turn."""
    for i in range(start, len(keys)):
        data = b"".join(batch.page(i))
        held.hold(keys[i], data)
    return len(keys) - start


def writer(setup: str, store: FilePageStore, pool: torch.Tensor, pages: int, calls: int,
           done: threading.Event, out: dict[str, float]) -> None:
    """`calls` dormant write calls of `pages` pages each (no reuse: every page skipped)."""
    t = TierState(KvTiersConfig(start_active=False), "bench:1", TierMeter())
    n_pool = pool.shape[0]

    def page(i: int) -> list[memoryview]:
        row = pool[i % n_pool]
        step = PAGE // BLOCKS
        return [memoryview(row[b * step:(b + 1) * step].numpy()).cast("B") for b in range(BLOCKS)]

    hold = hold_before if setup == "before" else write_path.hold_tail
    orig = write_path.hold_tail
    write_path.hold_tail = hold
    try:
        t0 = time.perf_counter()
        for c in range(calls):
            keys = [f"{setup}-{c}-{i}" for i in range(pages)]
            batch = _FileBatch(store, keys, page)
            write_path.write_pages(t, _FileWriter(store), keys, batch)
        out["call_ms"] = (time.perf_counter() - t0) / calls * 1e3
        out["held"] = t.held.held
    finally:
        write_path.hold_tail = orig
        done.set()


def step() -> None:
    """One short pure-Python step of the stand-in scheduler loop (~20-50 us here)."""
    s = 0
    for i in range(300):
        s += i * i


def measure(setup: str, store: FilePageStore, pool: torch.Tensor, pages: int, calls: int,
            idle_s: float) -> dict[str, float]:
    done, out = threading.Event(), {}
    steps: list[float] = []
    th = None
    if setup != "idle":
        th = threading.Thread(target=writer, args=(setup, store, pool, pages, calls, done, out))
    t_end = time.perf_counter() + idle_s
    t0 = time.perf_counter()
    if th is not None:
        th.start()
    while not done.is_set() if th is not None else time.perf_counter() < t_end:
        a = time.perf_counter()
        step()
        steps.append(time.perf_counter() - a)
    wall = time.perf_counter() - t0
    if th is not None:
        th.join()
    steps.sort()
    # time the loop waited: each step's excess over twice the run's median step (a step that waited
    # for the GIL, or lost the CPU), summed; per write call where there is a writer
    med = steps[len(steps) // 2]
    stalled = sum(x - 2 * med for x in steps if x > 2 * med)
    res = {"steps_per_s": len(steps) / wall, "step_p99_us": steps[int(0.99 * (len(steps) - 1))] * 1e6,
           "step_max_us": steps[-1] * 1e6, "wall_s": wall, "stalled_ms": stalled * 1e3, **out}
    if th is not None:
        res["stalled_ms_per_call"] = stalled * 1e3 / calls
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=544, help="pages per write call (an 8.7K-token prompt: 544)")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pool-pages", type=int, default=64, help="distinct host-pool pages the calls cycle over")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results-name", default="write_path_gil")
    ap.add_argument("--results-root", default=str(Path(__file__).resolve().parents[2]))
    a = ap.parse_args()
    command = "python benchmarks/kv_tiers/write_path_gil.py " + " ".join(sys.argv[1:])
    pool = torch.randint(0, 255, (a.pool_pages, PAGE), dtype=torch.uint8)
    recs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        store = FilePageStore(d, "bench", capacity_bytes=1 << 30)
        idle_s = 1.0
        for r in range(a.repeats):
            order = SETUPS if r % 2 == 0 else SETUPS[::-1]
            for s in order:
                m = measure(s, store, pool, a.pages, a.calls, idle_s)
                recs.append({"setup": s, "repeat": r, **m})
                print(f"  rep {r} {s:9s} steps/s {m['steps_per_s']:9.0f} p99 {m['step_p99_us']:7.1f} us "
                      f"max {m['step_max_us']:8.1f} us" + (f", call {m['call_ms']:.1f} ms, held {m['held']}"
                                                           if "call_ms" in m else ""), file=sys.stderr, flush=True)
    metrics = summarize(recs)
    print_table(metrics, a)
    if a.record:
        path = write_record("kv_tiers", a.results_name, command, metrics, root=Path(a.results_root),
                            shared="shared 2-core machine", records=recs)
        print(f"recorded {path}")
    return 0


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup each figure's spread over repeats; the loop's rate during the writer's calls as a
    ratio to idle (paired by repeat) and kv_tiers against before."""
    per: Callable[[str, str], list[float]] = lambda s, k: [r[k] for r in sorted(recs, key=lambda r: r["repeat"])
                                                           if r["setup"] == s and k in r]
    out: dict[str, Any] = {}
    for s in SETUPS:
        out[s] = {k: {q: v for q, v in stats.spread(per(s, k)).items() if q != "repeats"}
                  for k in ("steps_per_s", "step_p99_us", "step_max_us", "call_ms", "stalled_ms_per_call") if per(s, k)}
    for s in ("before", "kv_tiers"):
        out[f"{s}_steps_vs_idle"] = stats.ratio_of_medians(per(s, "steps_per_s"), per("idle", "steps_per_s"))
    out["kv_tiers_vs_before"] = {k: stats.ratio_of_medians(per("kv_tiers", k), per("before", k))
                                 for k in ("steps_per_s", "call_ms", "stalled_ms_per_call")}
    return out


def print_table(m: dict[str, Any], a: argparse.Namespace) -> None:
    print(f"dormant L3 write calls of {a.pages} pages of {PAGE >> 20} MiB ({a.calls} per run, {a.repeats} "
          f"repeats interleaved), a pure-Python loop on the main thread meanwhile (medians [min-max])")
    print(f"{'setup':9s} {'loop steps/s':>24s} {'vs idle':>8s} {'step p99 us':>12s} {'call ms':>22s} "
          f"{'loop ms stalled per call':>24s}")
    for s in SETUPS:
        f = m[s]
        sp = f["steps_per_s"]
        vs = m.get(f"{s}_steps_vs_idle", {}).get("ratio", 1.0)
        call = f.get("call_ms")
        call_s = stats.fmt_spread(call, 1) if call else "-"
        lost_s = stats.fmt_spread(f["stalled_ms_per_call"], 1) if "stalled_ms_per_call" in f else "-"
        print(f"{s:9s} {sp['median']:10.0f} [{sp['min']:.0f}-{sp['max']:.0f}] {vs:8.3f} "
              f"{f['step_p99_us']['median']:12.1f} {call_s:>22s} {lost_s:>24s}")
    r = m["kv_tiers_vs_before"]
    print(f"kv_tiers / before: loop steps {stats.fmt_spread(r['steps_per_s'], 2)}x, call time "
          f"{stats.fmt_spread(r['call_ms'], 3)}x, loop time stalled per call {stats.fmt_spread(r['stalled_ms_per_call'], 3)}x")


if __name__ == "__main__":
    sys.exit(main())
