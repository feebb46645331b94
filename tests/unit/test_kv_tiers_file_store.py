"""Unit tests of the kv_tiers file store (core, no SGLang): bounds, atomicity, refusal of bad pages."""
from __future__ import annotations

import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kllm_plugins.plugins.kv_tiers.core.fetch_policy import FetchOrRecompute
from kllm_plugins.plugins.kv_tiers.core.cost_model import CostPrior
from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore, calibrate_reads
from kllm_plugins.plugins.kv_tiers.core.page_format import HEADER_SIZE


def _store(tmp_path, capacity: int = 10_000, namespace: str = "model-a|layer_first|bf16|tp0", **kw) -> FilePageStore:
    return FilePageStore(str(tmp_path), namespace, capacity, **kw)


@pytest.mark.parametrize("iov_max", [1024, 3])
def test_a_page_in_blocks_is_stored_as_one_page_and_read_back_into_blocks(tmp_path, monkeypatch, iov_max) -> None:
    from kllm_plugins.plugins.kv_tiers.core import file_store

    monkeypatch.setattr(file_store, "_IOV_MAX", iov_max)  # 3: more blocks than one readv/writev takes
    s = _store(tmp_path)
    blocks = [bytes([i]) * (5 + i) for i in range(4)]
    assert s.put("k", [memoryview(b) for b in blocks])
    assert s.get("k") == b"".join(blocks)  # one page, whichever way it was written
    assert s.used_bytes == HEADER_SIZE + sum(map(len, blocks))
    out = [bytearray(len(b)) for b in blocks]
    assert s.get_into("k", [memoryview(o) for o in out])
    assert [bytes(o) for o in out] == blocks
    # blocks of the wrong total size, or a damaged payload, are refused
    assert not s.get_into("k", [memoryview(bytearray(5)), memoryview(bytearray(6))])
    assert s.put("k2", b"".join(blocks))
    raw = bytearray(open(s.path_of("k2"), "rb").read())
    raw[HEADER_SIZE + 7] ^= 1
    open(s.path_of("k2"), "wb").write(bytes(raw))
    assert not s.get_into("k2", [memoryview(bytearray(len(b))) for b in blocks])
    assert s.stats.faults.get("corrupt") == 1


def test_put_get_round_trip_and_get_into(tmp_path) -> None:
    s = _store(tmp_path)
    assert s.get("k1") is None
    assert s.put("k1", b"abc" * 10)
    assert s.exists("k1")
    assert s.get("k1") == b"abc" * 10
    buf = bytearray(30)
    assert s.get_into("k1", memoryview(buf))
    assert bytes(buf) == b"abc" * 10
    assert s.stats.hits == 2 and s.stats.misses == 1
    assert s.used_bytes == HEADER_SIZE + 30


def test_capacity_evicts_least_recently_used(tmp_path) -> None:
    page = b"x" * 100
    s = _store(tmp_path, capacity=3 * (HEADER_SIZE + 100))
    removed: list[str] = []
    s.on_remove = removed.append
    for k in ("a", "b", "c"):
        assert s.put(k, page)
    assert s.get("a") == page  # a becomes most recent
    assert s.put("d", page)
    assert removed == ["b"]
    assert not s.exists("b") and not os.path.exists(s.path_of("b"))
    assert sorted(s.keys()) == ["a", "c", "d"]
    assert s.used_bytes <= s.capacity_bytes
    assert s.stats.evictions == 1


def test_page_larger_than_capacity_is_refused(tmp_path) -> None:
    s = _store(tmp_path, capacity=100)
    assert not s.put("big", b"y" * 200)
    assert not s.exists("big")
    assert s.stats.faults["too_large"] == 1


@pytest.mark.parametrize(
    "damage, fault",
    [
        (lambda raw: raw[: HEADER_SIZE + 5], "truncated"),
        (lambda raw: raw[:-1] + bytes([raw[-1] ^ 0xFF]), "corrupt"),
        (lambda raw: raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], "corrupt"),  # header byte
        (lambda raw: raw[:61] + bytes([raw[61] ^ 0x5A]) + raw[62:], "corrupt"),  # header padding (no CRC)
        (lambda raw: raw[:10], "truncated"),
        (lambda raw: raw + b"zz", "corrupt"),
        (lambda raw: b"", "truncated"),
    ],
)
def test_damaged_page_is_a_miss_and_deleted(tmp_path, damage, fault) -> None:
    s = _store(tmp_path)
    payload = bytes(range(256)) * 2
    assert s.put("k", payload)
    path = s.path_of("k")
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(damage(raw))
    assert s.get("k") is None
    assert s.stats.faults[fault] == 1
    assert not s.exists("k") and not os.path.exists(path)
    # get_into refuses as well (fresh damaged copy)
    assert s.put("k", payload)
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(damage(raw))
    out = bytearray(len(payload))
    assert not s.get_into("k", memoryview(out))


def test_foreign_page_is_refused_but_left_in_place(tmp_path) -> None:
    a = _store(tmp_path, namespace="model-a")
    b = _store(tmp_path, namespace="model-b")
    assert a.put("k", b"A" * 64)
    # a page of model-a copied where model-b looks for it
    os.makedirs(b.folder, exist_ok=True)
    with open(a.path_of("k"), "rb") as src, open(b.path_of("k"), "wb") as dst:
        dst.write(src.read())
    assert b.exists("k")  # presence only
    assert b.get("k") is None
    assert b.stats.faults["foreign"] == 1
    assert os.path.exists(b.path_of("k"))
    assert a.get("k") == b"A" * 64


def test_misplaced_page_is_refused(tmp_path) -> None:
    s = _store(tmp_path)
    assert s.put("k1", b"1" * 32)
    os.replace(s.path_of("k1"), s.path_of("k2"))
    assert s.exists("k2")
    assert s.get("k2") is None
    assert s.stats.faults["misplaced"] == 1


def test_size_mismatch_with_reader_is_a_miss(tmp_path) -> None:
    s = _store(tmp_path)
    assert s.put("k", b"z" * 40)
    assert not s.get_into("k", memoryview(bytearray(48)))
    assert s.get("k", expected_len=48) is None
    assert s.get("k") == b"z" * 40  # the page itself was not damaged


def test_restart_adopts_pages_and_drops_temporaries(tmp_path) -> None:
    s = _store(tmp_path)
    for i in range(5):
        assert s.put(f"k{i}", bytes([i]) * 50)
    open(os.path.join(s.folder, ".tmp-deadbeef"), "wb").write(b"half")
    s2 = _store(tmp_path)
    assert sorted(s2.keys()) == [f"k{i}" for i in range(5)]
    assert s2.get("k3") == bytes([3]) * 50
    assert not os.path.exists(os.path.join(s.folder, ".tmp-deadbeef"))
    # a smaller capacity on restart evicts down to the bound
    s3 = _store(tmp_path, capacity=2 * (HEADER_SIZE + 50))
    assert len(s3) == 2 and s3.used_bytes <= s3.capacity_bytes


def test_store_down_at_start_then_lost_mid_run(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    down = FilePageStore(str(blocker), "ns", 10_000)  # root is a file: store down
    assert not down.put("k", b"x")
    assert down.get("k") is None
    assert down.stats.faults.get("io_error", 0) >= 1

    s = _store(tmp_path / "ok")
    assert s.put("k", b"v" * 10)
    for name in os.listdir(s.folder):
        os.unlink(os.path.join(s.folder, name))
    os.rmdir(s.folder)  # store lost
    assert s.get("k") is None
    assert s.stats.faults["missing"] == 1
    assert not s.exists("k")
    assert s.put("k2", b"w" * 10)  # recreated
    assert s.get("k2") == b"w" * 10


def test_shared_folder_sees_pages_of_another_process(tmp_path) -> None:
    a = _store(tmp_path)
    b = _store(tmp_path)
    assert a.put("k", b"q" * 20)
    assert b.exists("k") and b.get("k") == b"q" * 20
    c = _store(tmp_path, shared=False)
    assert a.put("k2", b"r" * 20)
    assert not c.exists("k2")


def test_page_written_by_another_instance_is_adopted_not_rewritten(tmp_path) -> None:
    writes: list[tuple[str, int]] = []
    a = _store(tmp_path)
    b = _store(tmp_path, on_transfer=lambda d, n, s: writes.append((d, n)))
    assert a.put("k", b"q" * 20)
    before = os.stat(a.path_of("k")).st_mtime_ns
    assert b.put("k", b"q" * 20)  # the page is in the shared folder: nothing written again
    assert writes == [] and b.stats.puts == 0 and b.stats.put_existing == 1
    assert os.stat(a.path_of("k")).st_mtime_ns == before
    assert "k" in b.keys() and b.used_bytes == HEADER_SIZE + 20
    assert b.get("k") == b"q" * 20
    # a file of another size under the key is not taken for the page: it is written over
    with open(a.path_of("k2"), "wb") as f:
        f.write(b"short")
    assert b.put("k2", b"r" * 20) and b.stats.puts == 1 and b.get("k2") == b"r" * 20
    # a store that does not share its folder writes what it has not written itself
    c = _store(tmp_path, shared=False)
    assert a.put("k3", b"s" * 20)
    assert c.put("k3", b"s" * 20) and c.stats.puts == 1 and c.stats.put_existing == 0


def test_unsafe_keys_are_hashed_into_file_names(tmp_path) -> None:
    s = _store(tmp_path)
    key = "../../etc/passwd"
    assert s.put(key, b"p" * 8)
    assert os.path.dirname(s.path_of(key)) == s.folder
    assert s.get(key) == b"p" * 8


def test_concurrent_writers_and_readers_never_see_bad_pages(tmp_path) -> None:
    s = _store(tmp_path, capacity=20 * (HEADER_SIZE + 256))
    errors: list[str] = []

    def worker(tid: int) -> None:
        for i in range(60):
            key = f"k{(tid * 7 + i) % 30}"
            payload = key.encode().ljust(256, b".")
            s.put(key, payload)
            got = s.get(key)
            if got is not None and got != payload:
                errors.append(key)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert s.used_bytes <= s.capacity_bytes
    assert s.used_bytes == sum(os.path.getsize(s.path_of(k)) for k in s.keys())


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/evict/corrupt sequences against a model of what may legally be served."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="kvt-hyp-")
        self.capacity = 6 * (HEADER_SIZE + 40)
        self.store = FilePageStore(self.tmp, "ns", self.capacity)
        self.written: dict[str, bytes] = {}  # last payload put per key
        self.damaged: set[str] = set()
        self.pristine: dict[str, bytes] = {}  # file bytes as written

    keys = st.sampled_from([f"k{i}" for i in range(10)])

    @rule(key=keys, size=st.integers(1, 40), fill=st.integers(0, 255))
    def put(self, key: str, size: int, fill: int) -> None:
        payload = bytes([fill]) * size
        present = self.store.exists(key)
        ok = self.store.put(key, payload)
        assert ok
        if not present:
            self.written[key] = payload
            self.damaged.discard(key)
            self.pristine[key] = open(self.store.path_of(key), "rb").read()

    @rule(key=keys)
    def get(self, key: str) -> None:
        got = self.store.get(key)
        if got is not None:
            assert key not in self.damaged
            assert got == self.written[key]
        elif key in self.damaged:
            self.damaged.discard(key)
            assert not self.store.exists(key)

    @rule(key=keys, how=st.sampled_from(["flip", "truncate", "append"]), pos=st.integers(0, 200))
    def corrupt(self, key: str, how: str, pos: int) -> None:
        if key not in self.store.keys():
            return
        path = self.store.path_of(key)
        raw = bytearray(open(path, "rb").read())
        if not raw:  # already truncated to nothing
            return
        if how == "flip":
            raw[pos % len(raw)] ^= 0x5A
        elif how == "truncate":
            raw = raw[: pos % len(raw)]
        else:
            raw += b"\0"
        open(path, "wb").write(bytes(raw))
        if bytes(raw) != self.pristine[key]:
            self.damaged.add(key)
        else:
            self.damaged.discard(key)

    @precondition(lambda self: len(self.store) > 0)
    @rule()
    def remove_oldest(self) -> None:
        self.store.remove(self.store.keys()[0])

    @invariant()
    def bounded(self) -> None:
        assert self.store.used_bytes <= self.capacity
        # every file in the folder is indexed, and every indexed page has its file
        files = sorted(n[: -len(".kvp")] for n in os.listdir(self.store.folder) if not n.startswith("."))
        assert files == sorted(self.store.keys())

    def teardown(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@given(payload=st.binary(min_size=0, max_size=300))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_payload_round_trips(tmp_path, payload: bytes) -> None:
    s = _store(tmp_path, capacity=1 << 20)
    s.remove("p")
    assert s.put("p", payload)
    assert s.get("p") == payload


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 32768, 100_003])
def test_payload_checksum_is_crc32c_also_continued_across_parts(size: int) -> None:
    """The page checksum is CRC-32C (checked against a bitwise reference on small sizes), and the
    CRC of a page in several parts is that of their concatenation."""
    from kllm_plugins.plugins.kv_tiers.core.page_format import crc32c, crc_of

    def reference(data: bytes) -> int:  # CRC-32C, reflected polynomial 0x82F63B78
        crc = 0xFFFFFFFF
        for b in data:
            crc ^= b
            for _ in range(8):
                crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        return crc ^ 0xFFFFFFFF

    data = os.urandom(size)
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    if size <= 4097:
        assert crc32c(data) == reference(data)
    assert crc_of([data[: size // 3], memoryview(data[size // 3 :])]) == (size, crc32c(data))


def test_large_parts_are_checksummed_with_the_gil_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 MiB page part (an 8B model's page) releases the GIL while its CRC runs, so the scheduler's
    thread is not held by a storage thread's checksum; small parts keep it; the value is the same."""
    import crc32c as lib

    from kllm_plugins.plugins.kv_tiers.core import page_format

    modes: list[int] = []
    real = lib.crc32c
    monkeypatch.setattr(page_format._crc32c, "crc32c", lambda d, c, m: modes.append(m) or real(d, c, m))
    big, small = os.urandom(2 << 20), os.urandom(32 << 10)
    got = page_format.crc_of([memoryview(big), small, big[:page_format.GIL_RELEASE_BYTES]])
    assert modes == [1, 0, 1]
    monkeypatch.setattr(page_format._crc32c, "crc32c", real)
    assert got == page_format.crc_of([big + small + big[:page_format.GIL_RELEASE_BYTES]])

class _SlowStore(FilePageStore):
    """A store whose served reads cost 5 ms more (as the benchmarks' slow medium adds its delay)."""

    def _served(self, key: str, nbytes: int, seconds: float) -> None:
        super()._served(key, nbytes, seconds + 0.005)


@pytest.mark.parametrize("cls", [FilePageStore, _SlowStore])
def test_calibration_measures_the_store_class_and_leaves_nothing(tmp_path, cls) -> None:
    serving = cls(str(tmp_path), "ns", 1 << 20)
    reads: list[tuple[str, int, float]] = []
    fetch = FetchOrRecompute(1024, l2_prior=CostPrior(20e-6, 1e-10), l3_prior=CostPrior(200e-6, 1e-9),
                             prefill_prior=CostPrior(0.0, 2e-4))

    def scratch(ns: str) -> FilePageStore:
        def seen(d: str, n: int, s: float) -> None:
            reads.append((d, n, s))
            if d == "read":
                fetch.observe_transfer("l3", n, s)
        return type(serving)(str(tmp_path), f"ns|{ns}", 1 << 20, shared=False, on_transfer=seen)

    assert calibrate_reads(scratch, 4096, 4) == 4
    got = [r for r in reads if r[0] == "read"]
    assert len(got) == 4 and all(n == 4096 for _, n, _ in got)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(serving.folder)]  # the scratch folder is gone
    assert len(serving) == 0
    snap = fetch.snapshot()
    assert snap["l3_samples"] == 4.0
    per_byte = 1.0 / snap["l3_bandwidth_bytes_per_s"]
    # the prior (1 ns a byte) is replaced by these reads: equal page sizes, so all per byte
    assert per_byte == pytest.approx(sum(s for _, _, s in got) / (4 * 4096), rel=1e-6)
    if cls is _SlowStore:  # and the slow store's delay is in it
        assert per_byte * 4096 >= 0.005
    assert calibrate_reads(scratch, 4096, 0) == 0
