"""kv_tiers' Mooncake backend (`KllmMooncakeStorage`) against a real `mooncake_master` (no server).

SGLang's own `MooncakeStore` does the I/O (zero-copy `batch_*_v1` into a host pool); the host
pool is a stand-in with the page_first_direct pointer arithmetic of SGLang's MHA host pool.
Checked here: selective persistence, measured reads feeding fetch-or-recompute, page records
refusing corrupt and foreign pages, a full store, the master down at start, lost mid-run and
back, stalled (a miss within the call timeout, not a 30 s wait) and then resumed or killed, a
dropped or closed backend stopping its re-attach thread, EXTERNAL tier events, cross-instance
reads (a second client sees the first's pages), and shared sightings: offer markers in the
store let a page seen once on each of two clients be written by the second; a master gone or
stalled leaves sightings local (counted, no delay).
"""
from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import time
import weakref
from typing import Any, Iterator

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.testing import mooncake_master_path
from kllm_plugins.testing.sglang_server import free_port

pytestmark = pytest.mark.sglang

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4


class _HostPool:
    """What MooncakeStore reads of an MHA host pool, page_first_direct layout."""

    layout = "page_first_direct"
    page_size = PAGE
    dtype = torch.float32

    def __init__(self, tokens: int = 256) -> None:
        self.size = tokens
        self.kv_buffer = torch.zeros(2, tokens, LAYERS, HEADS, DIM, dtype=self.dtype)

    def get_ksize_per_token(self) -> int:
        return LAYERS * HEADS * DIM * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base, tok = self.kv_buffer.data_ptr(), self.get_ksize_per_token()
        v_off = self.size * tok
        ptrs: list[int] = []
        for i in indices.tolist()[:: self.page_size]:
            ptrs += [base + i * tok, base + i * tok + v_off]
        return ptrs, [tok * self.page_size] * len(ptrs)

    def fill(self, page: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        sl = slice(page * PAGE, (page + 1) * PAGE)
        self.kv_buffer[:, sl] = torch.randn(self.kv_buffer[:, sl].shape, generator=g)

    def page(self, page: int) -> torch.Tensor:
        return self.kv_buffer[:, page * PAGE:(page + 1) * PAGE].clone()


def _start_master(log: Any, rpc: int, http: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    # a free metrics port too: its default (9003) would collide with any other master on the machine
    proc = subprocess.Popen(
        [mooncake_master_path(), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
         f"-http_metadata_server_port={http}", f"-metrics_port={free_port()}", *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    from kllm_plugins.plugins.kv_tiers.sglang_adapter.mooncake_storage import master_reachable

    while not master_reachable(f"127.0.0.1:{rpc}"):
        assert proc.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
        time.sleep(0.2)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)


@pytest.fixture()
def master(tmp_path) -> Iterator[dict[str, Any]]:
    pytest.importorskip("mooncake.store")
    if mooncake_master_path() is None:
        pytest.skip("mooncake_master not installed (pip mooncake-transfer-engine-non-cuda)")
    rpc, http = free_port(), free_port()
    log = open(tmp_path / "master.log", "wb")
    state = {"rpc": rpc, "http": http, "log": log, "proc": _start_master(log, rpc, http)}
    try:
        yield state
    finally:
        _stop(state["proc"])


def _storage_config(extra: dict[str, Any], model: str = "tiny-llama") -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model, extra_config=extra,
    )


@pytest.fixture()
def make(master, monkeypatch):
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state
    from kllm_plugins.plugins.kv_tiers.sglang_adapter.mooncake_storage import KllmMooncakeStorage

    built: list[weakref.ref[Any]] = []

    def build(model: str = "tiny-llama", fresh: bool = True, pool: _HostPool | None = None,
              **extra: Any) -> tuple[Any, _HostPool]:
        if fresh:
            monkeypatch.setattr(state, "_tiers", None)
        cfg = {"backend_name": "kllm_mooncake", "interface_v1": 1,
               "master_server_address": f"127.0.0.1:{master['rpc']}",
               "metadata_server": f"http://127.0.0.1:{master['http']}/metadata", "protocol": "tcp",
               "device_name": "", "global_segment_size": 16 << 20, "local_hostname": "127.0.0.1",
               "check_server": False, "reconnect_s": 0.5,
               # patient store calls, except where a test is about a slow store
               "store_timeout_ms": 10_000, "probe_timeout_ms": 10_000,
               # these tests pin down the selective rule itself (sightings, pressure), not the default
               # of writing everything while the store has room
               "write_all_below_pressure": False, **extra}
        b = KllmMooncakeStorage(_storage_config(cfg, model), {})
        built.append(weakref.ref(b))
        pool = pool or _HostPool()
        b.register_mem_pool_host(pool)
        return b, pool

    yield build
    # stop the clients (and their threads) here, not at interpreter exit; a client whose master
    # is gone takes ~12 s to close, one with a master (even a restarted one) does not
    if master["proc"].poll() is not None:
        master["proc"] = _start_master(master["log"], master["rpc"], master["http"])
    for ref in built:
        b = ref()
        if b is not None:
            b.close()


def _keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def _idx(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def _write(b: Any, pool: _HostPool, keys: list[str], seed: int = 0) -> list[bool]:
    for p in range(len(keys)):
        pool.fill(p, seed + p)
    return b.batch_set_v1(keys, _idx(0, len(keys)))


def test_selective_persistence_then_verified_read_feeds_the_cost_model(make) -> None:
    b, pool = make(min_reuse=2)
    keys = _keys(3, "a")
    assert _write(b, pool, keys) == [True] * 3  # first sighting: skipped by choice
    assert b.batch_exists(keys) == 0
    assert b.t.counts["pages_skipped"] == 3 and b.t.counts["pages_admitted"] == 0
    assert _write(b, pool, keys) == [True] * 3  # second sighting: written
    assert b.batch_exists(keys) == 3
    want = [pool.page(p) for p in range(3)]
    before = b.t.fetch.snapshot()
    assert b.batch_get_v1(keys, _idx(10, 3)) == [True] * 3
    for p in range(3):
        assert torch.equal(pool.page(10 + p), want[p])
    snap = b.t.snapshot()
    assert snap["backend"] == "mooncake" and snap["store"]["hits"] == 3 and not snap["store"]["faults"]
    assert b.t.fetch.snapshot() != before  # the read was measured
    ev = b.t.events.take()
    assert len(ev) == 1 and ev[0].medium == "EXTERNAL" and list(ev[0].keys) == keys


def test_pages_skipped_while_dormant_are_written_once_reuse_is_seen(make) -> None:
    """`dormant_hold_mb` with Mooncake, as with the file store (one write path): a first turn
    offered while no reuse is seen is not written but held; once a lookup shows reuse the held
    pages are written (K and V objects and their records), so another instance reads them, each
    page as it was offered. With the hold off they are dropped."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    dormant = {"start_active": False, "reuse_window": 4, "min_reuse": 2, "write_all_below_pressure": True}
    b, pool = make(**dormant)
    first = [_keys(2, f"turn1-{i}") for i in range(2)]
    want = {}
    for i, keys in enumerate(first):
        assert b.batch_exists(keys) == 0
        assert _write(b, pool, keys, seed=10 * i) == [True, True]  # skipped by choice: not a failure
        want.update({k: pool.page(p) for p, k in enumerate(keys)})
    snap = b.t.snapshot()
    assert snap["write_mode"] == "dormant" and snap["held"]["pages"] == 4, snap["held"]
    assert b.t.counts["pages_admitted"] == 0 and all(b.batch_exists(k) == 0 for k in first)
    # the next turn extends the first: reuse is seen, and its write sends the held pages too
    assert b.batch_exists(_keys(1, "turn2"), HiCacheStorageExtraInfo(prefix_keys=first[0])) == 0
    assert _write(b, pool, _keys(1, "turn2"), seed=99) == [True]
    assert b.t.counts["held_written"] == 4 and b.t.snapshot()["held"]["pages"] == 0
    assert b.t.snapshot()["write_mode"] == "active"
    other, pool_o = make(fresh=False)  # another client of the master
    for keys in first:
        assert other.batch_exists(keys) == 2
        assert other.batch_get_v1(keys, _idx(20, 2)) == [True, True]  # records checked on the read
        for p, k in enumerate(keys):
            assert torch.equal(pool_o.page(20 + p), want[k])
    assert not other.t.snapshot()["store"]["faults"]
    stored = [k for e in b.t.events.take() if e.kind == "stored" for k in e.keys]
    assert set(stored) >= {k for keys in first for k in keys}  # EXTERNAL events for the held pages too

    off, pool_off = make(**dormant, dormant_hold_mb=0)
    keys = _keys(2, "off")
    assert _write(off, pool_off, keys) == [True, True] and off.t.snapshot()["held"]["pages"] == 0
    assert off.batch_exists(_keys(1, "y"), HiCacheStorageExtraInfo(prefix_keys=keys)) == 0
    assert _write(off, pool_off, _keys(1, "y")) == [True] and off.batch_exists(keys) == 0


def test_second_client_reads_pages_of_the_first(make) -> None:
    a, pool_a = make(min_reuse=1)
    keys = _keys(2, "x")
    assert _write(a, pool_a, keys, seed=7) == [True, True]
    want = [pool_a.page(p) for p in range(2)]
    b, pool_b = make(min_reuse=1)  # another instance: its own client and host pool
    assert b.batch_exists(keys) == 2
    assert b.batch_get_v1(keys, _idx(4, 2)) == [True, True]
    assert torch.equal(pool_b.page(4), want[0]) and torch.equal(pool_b.page(5), want[1])


def test_corrupt_page_is_refused_and_cuts_the_prefix(make, caplog) -> None:
    b, pool = make(min_reuse=1)
    keys = _keys(3, "c")
    assert _write(b, pool, keys) == [True] * 3
    # another writer replaces page 1's K object with other bytes of the same size
    obj = f"{b._tag_keys([keys[1]])[0]}_{b.mha_suffix}_k"
    size = pool.get_ksize_per_token() * PAGE
    assert b.store.remove(obj) == 0 and b.store.put(obj, os.urandom(size)) == 0
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        got = b.batch_get_v1(keys, _idx(10, 3))
    assert got == [True, False, False]
    assert b.t.snapshot()["store"]["faults"] == {"corrupt": 1}
    assert "refused (corrupt" in caplog.text


def test_pages_of_another_layout_are_refused(make) -> None:
    a, pool_a = make(min_reuse=1)
    keys = _keys(2, "f")
    assert _write(a, pool_a, keys) == [True, True]
    # same model name, keys and sizes, other layout: Mooncake's own key prefix does not tell them apart
    pool_b = _HostPool()
    pool_b.layout = "page_first"
    b, _ = make(min_reuse=1, pool=pool_b)
    assert b.batch_get_v1(keys, _idx(10, 2)) == [False, False]
    assert b.t.snapshot()["store"]["faults"] == {"foreign": 1}
    # another dtype: the objects have another size, Mooncake's read fails, counted too
    pool_c = _HostPool()
    pool_c.dtype = torch.float16
    c, _ = make(min_reuse=1, pool=pool_c)
    assert c.batch_get_v1(keys, _idx(10, 2)) == [False, False]
    assert c.t.snapshot()["store"]["faults"] == {"read_failed": 1}


def test_full_store_refuses_writes_and_says_why(master, make, caplog) -> None:
    _stop(master["proc"])  # a master that never evicts, so "full" stays full
    master["proc"] = _start_master(master["log"], master["rpc"], master["http"],
                                   ("-eviction_high_watermark_ratio=1.0", "-eviction_ratio=0.0"))
    b, pool = make(min_reuse=1)
    n = 0
    for size in (1 << 20, 1 << 16, 1 << 12):  # fill the 16 MiB segment to the last bytes
        while b.store.put(f"filler{n}", bytes(size)) == 0:
            n += 1
            assert n < 200
    keys = _keys(4, "full")
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        for p in range(4):
            pool.fill(p, p)
        assert not all(b.batch_set_v1(keys, _idx(0, 4)))
    assert b.t.snapshot()["store"]["faults"].get("full", 0) >= 1
    assert "mooncake store full" in caplog.text
    assert b.batch_exists(keys) < 4  # what was not written is a miss, never a wrong page
    # a full store is capacity pressure: the reuse bar doubles (min_reuse 1 -> 2)
    assert b.t.persistence.threshold(1.0, 0.0) == 2
    assert b.batch_set_v1(_keys(2, "late"), _idx(0, 2)) == [True, True]  # skipped by choice
    assert b.t.counts["pages_skipped"] == 2


def test_master_down_at_start_then_back(master, make, caplog) -> None:
    _stop(master["proc"])
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        b, pool = make(min_reuse=1)
    assert time.monotonic() - t0 < 10  # no 90 s client retry loop at start-up
    assert not b.ready and "down at start" in caplog.text
    keys = _keys(2, "d")
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, _idx(0, 2)) == [False, False]
    assert _write(b, pool, keys) == [False, False]
    assert b.t.snapshot()["store"]["faults"]["down_at_start"] == 1
    master["proc"] = _start_master(master["log"], master["rpc"], master["http"])
    deadline = time.monotonic() + 30
    while not b.ready and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.ready
    assert _write(b, pool, keys) == [True, True] and b.batch_exists(keys) == 2


def test_master_lost_mid_run_is_a_miss(master, make, caplog) -> None:
    b, pool = make(min_reuse=1)
    keys = _keys(2, "l")
    assert _write(b, pool, keys) == [True, True]
    _stop(master["proc"])
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        for _ in range(3):
            assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, _idx(10, 2)) == [False, False]
    faults = b.t.snapshot()["store"]["faults"]
    assert faults.get("store_error", 0) >= 3 and faults.get("store_lost") == 1
    assert "store lost" in caplog.text and not b.ready


# -- shared sightings: offer markers in the Mooncake store ---------------------------------------

# generous wait for the marker check where the test is about sharing itself, so that a loaded
# machine does not turn a shared sighting into a local one
_PATIENT = {"min_reuse": 2, "sightings_timeout_ms": 10_000}


def _markers(b: Any, keys: list[str]) -> list[int]:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter.mooncake_markers import MooncakeMarkers

    return MooncakeMarkers(b).exists(keys)


def test_page_seen_once_on_each_of_two_instances_is_written_by_the_second(make) -> None:
    a, pool_a = make(**_PATIENT)
    b, pool_b = make(**_PATIENT)  # another instance: own client, host pool and policy
    keys, once = _keys(3, "shared"), _keys(2, "once")
    assert _write(a, pool_a, keys, seed=3) == [True] * 3  # A's first sighting: skipped, marked
    assert _write(a, pool_a, once) == [True] * 2
    assert a.sightings.drain()
    assert a.t.counts["pages_admitted"] == 0 and a.t.counts["pages_skipped"] == 5
    assert _markers(b, keys + once) == [1] * 5
    assert b.batch_exists(keys) == 0

    assert _write(b, pool_b, keys, seed=3) == [True] * 3  # B's first sighting is the page's second
    assert b.t.counts["pages_admitted"] == 3 and b.t.counts.get("sightings_shared") == 3
    assert b.t.counts.get("sightings_unshared", 0) == 0
    want = [pool_b.page(p) for p in range(3)]
    assert a.batch_exists(keys) == 3
    assert a.batch_get_v1(keys, _idx(20, 3)) == [True] * 3
    assert all(torch.equal(pool_a.page(20 + p), want[p]) for p in range(3))
    assert b.sightings.drain()
    assert _markers(b, keys) == [0] * 3  # written pages' markers are removed

    # a page offered once only (on A) is not written, and B offering other pages changes nothing
    assert a.batch_exists(once) == 0 and b.batch_exists(once) == 0
    other = _keys(2, "other")
    assert _write(b, pool_b, other) == [True] * 2
    assert b.t.counts["pages_admitted"] == 3 and b.batch_exists(other) == 0


def test_marker_check_is_skipped_when_every_page_is_written_at_first_sight(make) -> None:
    b, pool = make(min_reuse=1, sightings_timeout_ms=10_000)
    keys = _keys(2, "m1")
    assert _write(b, pool, keys) == [True, True] and b.batch_exists(keys) == 2
    assert b.sightings.drain()
    assert b.sightings.stats["checked"] == 0 and _markers(b, keys) == [0, 0]


def test_master_down_leaves_sightings_local_counted_not_raised(master, make, caplog) -> None:
    b, pool = make(**_PATIENT)
    _stop(master["proc"])  # the client still thinks it is attached (no failed call yet)
    keys = _keys(3, "down")
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        assert _write(b, pool, keys) == [True] * 3  # skipped by choice, nothing raised
    assert b.t.counts.get("sightings_unshared") == 3 and b.sightings.stats["unshared_error"] == 3
    assert b.t.counts.get("sightings_shared", 0) == 0 and b.t.counts["pages_skipped"] == 3
    assert "shared sightings: store did not answer (error)" in caplog.text


def test_stalled_master_does_not_hold_up_writes(master, make, caplog) -> None:
    b, pool = make(min_reuse=2, sightings_timeout_ms=50)
    keys, more = _keys(2, "slow"), _keys(2, "slow2")
    os.killpg(master["proc"].pid, signal.SIGSTOP)  # calls to it now wait ~30 s for an RPC timeout
    try:
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
            assert _write(b, pool, keys) == [True, True]
            assert _write(b, pool, more) == [True, True]  # the store thread is still stuck: not asked
        elapsed = time.monotonic() - t0
    finally:
        os.killpg(master["proc"].pid, signal.SIGCONT)
    assert elapsed < 10, elapsed  # far below the RPC timeout the check is stuck in
    st = b.sightings.stats
    assert st["unshared_timeout"] == 2 and st["unshared_busy"] == 2, st
    assert b.t.counts.get("sightings_unshared") == 4
    assert "store did not answer (timeout)" in caplog.text
    # once the master runs again the stuck check ends (its markers are put) and sharing resumes
    assert b.sightings.drain(60)
    b.sightings.timeout_s = 10.0
    fresh = _keys(1, "after")
    assert _write(b, pool, fresh) == [True]
    assert st["checked"] >= 3 and st["unshared_timeout"] == 2 and st["unshared_busy"] == 2
    assert b.sightings.drain() and _markers(b, keys + fresh) == [1] * 3


def test_sightings_of_another_layout_do_not_count(make) -> None:
    a, pool_a = make(**_PATIENT)
    pool_b = _HostPool()
    pool_b.layout = "page_first"  # same model and keys, pages that could not be served to A
    b, _ = make(pool=pool_b, **_PATIENT)
    keys = _keys(2, "ns")
    assert _write(a, pool_a, keys) == [True, True] and a.sightings.drain()
    assert _write(b, pool_b, keys) == [True, True]
    assert b.t.counts["pages_admitted"] == 0 and b.t.counts.get("sightings_shared", 0) == 0
    assert b.sightings.stats["checked"] == 2


# -- a slow or stalled master ---------------------------------------------------------------------


def test_stalled_master_costs_misses_not_stalls(master, make, caplog) -> None:
    b, pool = make(min_reuse=1, store_timeout_ms=300)
    keys, more = _keys(2, "st"), _keys(2, "st2")
    assert _write(b, pool, keys) == [True, True]
    want = [pool.page(p) for p in range(2)]
    os.killpg(master["proc"].pid, signal.SIGSTOP)  # TCP still connects; RPCs wait ~30 s for a timeout
    try:
        t0 = time.monotonic()
        with caplog.at_level("INFO", logger="kllm.kv_tiers"):
            assert b.batch_exists(keys) == 0  # given up after 300 ms: a miss
            assert b.batch_get_v1(keys, _idx(10, 2)) == [False, False]  # skipped at once
            assert _write(b, pool, more) == [False, False]  # skipped at once
            assert b.batch_exists(more) == 0  # the first lookup is still unanswered: not sent
        elapsed = time.monotonic() - t0
    finally:
        os.killpg(master["proc"].pid, signal.SIGCONT)
    assert elapsed < 10, elapsed  # one 300 ms wait, not four 30 s ones
    faults = b.t.snapshot()["store"]["faults"]
    assert faults == {"store_slow": 8}, faults  # 2 pages x (late lookup, read, write, lookup)
    assert b.ready and caplog.text.count("mooncake store slow") == 1
    # resumed: the stuck lookup returns, the next one is answered in time, L3 serves again
    deadline = time.monotonic() + 60
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        while b.batch_exists(keys) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert "mooncake store back" in caplog.text
    assert b.batch_get_v1(keys, _idx(10, 2)) == [True, True]
    assert torch.equal(pool.page(10), want[0]) and torch.equal(pool.page(11), want[1])
    assert _write(b, pool, more) == [True, True] and b.batch_exists(more) == 2


def test_stalled_then_killed_master_is_lost_then_reattached(master, make, caplog) -> None:
    b, pool = make(min_reuse=1, store_timeout_ms=300)
    keys = _keys(2, "sk")
    os.killpg(master["proc"].pid, signal.SIGSTOP)
    with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
        assert b.batch_exists(keys) == 0
        assert b.ready and b.bounded.slow  # stalled: slow, not lost (it still accepts connections)
        _stop(master["proc"])  # SIGKILL works on a stopped process
        deadline = time.monotonic() + 30
        while b.ready:  # further lookups: errors or late calls to a master that refuses connections
            assert b.batch_exists(keys) == 0
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert b.t.snapshot()["store"]["faults"].get("store_lost") == 1 and "store lost" in caplog.text
    master["proc"] = _start_master(master["log"], master["rpc"], master["http"])
    deadline = time.monotonic() + 60
    while not b.ready:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while b.bounded.slow:  # the episode of the stall ends with the first lookup answered in time
        assert b.batch_exists(keys) == 0 and time.monotonic() < deadline
        time.sleep(0.2)
    assert _write(b, pool, keys) == [True, True] and b.batch_exists(keys) == 2


def test_reattach_thread_neither_keeps_the_backend_alive_nor_outlives_close(master, make) -> None:
    keys = _keys(1, "gone")
    a, _ = make(min_reuse=1, reconnect_s=60, store_timeout_ms=300)
    b, _ = make(min_reuse=1, reconnect_s=60, store_timeout_ms=300)
    _stop(master["proc"])
    for backend in (a, b):
        while backend.ready:
            assert backend.batch_exists(keys) == 0
    del backend
    threads = [a._reattach, b._reattach]
    assert all(t is not None and t.is_alive() for t in threads)
    # a master again, so that the clients close quickly (with none, each close waits ~12 s)
    master["proc"] = _start_master(master["log"], master["rpc"], master["http"])
    a.close()
    threads[0].join(10)
    assert not threads[0].is_alive() and a.store is None
    deadline = time.monotonic() + 60
    while b.bounded.pending:  # a late lookup holds the backend until the client gives up on it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None  # the re-attach thread held it until exit (then ~12 s of client teardown)
    threads[1].join(10)
    assert not threads[1].is_alive()


# -- the prefetch hook's first-page probe -----------------------------------------------------------


class _Cache:
    """What the prefetch hook reads and writes of UnifiedRadixCache (pages of PAGE tokens)."""

    page_size = PAGE

    def __init__(self) -> None:
        self.ongoing_prefetch: dict[Any, Any] = {}
        self.prefetch_threshold = PAGE
        self.calls = 0

    def prefetch(self, request: Any, node: Any, tokens: list[int], *args: Any, **kwargs: Any) -> bool:
        self.calls += 1
        return True


def _hook(cache: _Cache) -> Any:
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    def prefetch(request: str, tokens: list[int], last_hash: Any = None, prefix_keys: Any = None) -> Any:
        return pf.around_prefetch_from_storage(_Cache.prefetch, cache, request, "node", tokens, last_hash, prefix_keys)

    return prefetch


def _median_us(fn: Any, n: int = 200) -> float:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    return sorted(took)[n // 2] * 1e6


def test_probe_finds_a_page_under_the_key_hicache_looks_up_and_a_miss_starts_no_prefetch(make) -> None:
    """The hook probes the first page's storage key before starting a prefetch (a miss would hold
    its request until HiCache's prefetch timeout): the key is the one HiCache's storage query
    computes, the answer the one its lookup gives; a miss starts nothing and still tells selective
    persistence about the continuation."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kllm_plugins.plugins.kv_tiers.sglang_adapter import prefetch as pf

    b, pool = make(min_reuse=1)
    cache = _Cache()
    prefetch = _hook(cache)
    tokens = list(range(300, 300 + 6 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)  # as HiCache's `_storage_hit_query`
    assert pf._page_keys(cache, tokens, (None,), {}, pages=1)[0] == keys[0]

    assert prefetch("r1", tokens, None, ["p0"]) is None  # nothing stored: no prefetch started
    assert cache.calls == 0 and b.t.counts["prefetch_probe_miss"] == 1
    assert all(b.t.persistence.continuations.count(k) == 1 for k in keys)  # reuse seen, as a lookup tells

    assert _write(b, pool, keys[:2]) == [True, True]  # written under HiCache's keys (a write-back)
    assert b.batch_exists(keys) == 2  # what HiCache's lookup answers now
    assert prefetch("r2", tokens) is True and cache.calls == 1
    assert b.t.counts["prefetch_admitted"] == 1 and b.t.counts["prefetch_probe_miss"] == 1
    # chained on an anchor's hash: another key, not stored
    chained = get_storage_hash_str(tokens[:PAGE], keys[0], page_size=PAGE)[0]
    assert pf._page_keys(cache, tokens, (keys[0],), {}, pages=1)[0] == chained != keys[0]
    assert prefetch("r3", tokens, keys[0]) is None and cache.calls == 1
    # the first page's V object gone (evicted by the master): the lookup and the probe both miss
    obj = f"{b._tag_keys([keys[0]])[0]}_{b.mha_suffix}_v"
    assert b.store.remove(obj, True) == 0
    assert b.batch_exists(keys) == 0
    assert prefetch("r4", tokens) is None and cache.calls == 1 and b.t.counts["prefetch_probe_miss"] == 3
    assert b.t.path_calls["probe"] == 4 and not b.t.snapshot()["store"]["faults"]

    # what a probe costs on a healthy local master (shown with -s; not asserted: a loaded machine)
    hit, miss = keys[1], chained
    costs = {"probe hit (bounded: thread + K/V + record checks)": _median_us(lambda: b.probe(hit)),
             "probe miss (bounded: thread + K/V check)": _median_us(lambda: b.probe(miss)),
             "one unbounded existence RPC": _median_us(lambda: b.store.batch_is_exist([obj]))}
    print("median cost per call (us):", {k: round(v) for k, v in costs.items()})


def test_probe_never_holds_the_scheduler_longer_than_its_wait_and_misses_during_a_stall(master, make,
                                                                                       caplog) -> None:
    """The probe runs on the scheduler thread: against a stalled master it waits `probe_timeout_ms`
    at most and then lets HiCache's lookup (on its own thread, bounded by `store_timeout_ms`)
    decide; once that lookup has found the master slow, probes answer a miss at once."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    b, pool = make(min_reuse=1, store_timeout_ms=2000, probe_timeout_ms=50)
    cache = _Cache()
    prefetch = _hook(cache)
    tokens = list(range(900, 900 + 4 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    assert _write(b, pool, keys) == [True] * 4
    os.killpg(master["proc"].pid, signal.SIGSTOP)  # TCP still connects; RPCs wait ~30 s for a timeout
    try:
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="kllm.kv_tiers"):
            assert prefetch("s1", tokens) is True  # unanswered within 50 ms: the prefetch starts
            assert prefetch("s2", tokens) is True  # that probe is still unanswered: none sent
            probes = time.monotonic() - t0
            assert b.batch_exists(keys) == 0  # the prefetch's lookup: given up after 2 s, a miss
            lookup = time.monotonic() - t0 - probes
            assert prefetch("s3", tokens) is None  # slow episode: a miss at once, no prefetch
        elapsed = time.monotonic() - t0
    finally:
        os.killpg(master["proc"].pid, signal.SIGCONT)
    # the scheduler's probes waited 50 ms (bound: half the lookup's 2 s), the lookup its 2 s; none
    # waited for the RPC timeout (~30 s)
    assert probes < 1.0 and lookup >= 1.9 and elapsed < 15, (probes, lookup, elapsed)
    assert cache.calls == 2 and b.t.counts["probe_unanswered"] == 2 and b.t.counts["prefetch_probe_miss"] == 1
    assert b.t.snapshot()["store"]["faults"] == {"store_slow": 5}  # the late lookup's 4 pages, the probe
    assert caplog.text.count("mooncake store slow") == 1 and "slow: lookup no answer within 2000 ms" in caplog.text
    deadline = time.monotonic() + 60
    while b.batch_exists(keys) != 4:  # resumed: the stuck calls return, a lookup in time ends the episode
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert prefetch("s4", tokens) is True and cache.calls == 3 and not b.bounded.slow
