"""Layer: plugin core (no SGLang import). A bounded, checked, local file store for KV pages (L3).

Pages are files named after their key inside a per-namespace folder. Writes go to a temporary
file in the same folder and are published with `os.replace`, so a reader sees a whole page or
none. Every page carries a checksummed header (`page_format`); a page that is corrupt,
truncated, misplaced or written under another namespace is refused (a miss), counted by reason
and, unless it belongs to another namespace, deleted. Capacity is bounded in bytes and enforced
by evicting the least recently used pages before a write is admitted.

The store never raises into its caller for I/O trouble: a missing or unwritable folder (store
down or lost) turns every call into a miss or a refused write, and `stats.faults` says why.
Thread-safe: HiCache calls it from its prefetch and backup threads at once.
"""
from __future__ import annotations

import logging
import os
import re
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kllm_plugins.plugins.kv_tiers.core.page_format import (
    HEADER_SIZE,
    VERSION,
    PageError,
    PageFault,
    check_page,
    decode_header,
    digest16,
    encode_header,
    payload_parts,
)

logger = logging.getLogger("kllm.kv_tiers")

# most buffers one readv / writev takes (a page in more blocks goes through one flat buffer)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")
SUFFIX = ".kvp"

TransferObserver = Callable[[str, int, float], None]
"""Called as (direction "read"|"write", bytes, seconds) after each successful page transfer."""
KeyObserver = Callable[[str], None]


@dataclass
class StoreStats:
    puts: int = 0
    put_bytes: int = 0
    put_refused: int = 0
    gets: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    put_existing: int = 0
    """puts answered by a page another instance sharing the folder had written (nothing rewritten)"""
    faults: dict[str, int] = field(default_factory=dict)

    def fault(self, reason: PageFault | str) -> None:
        key = reason.value if isinstance(reason, PageFault) else reason
        self.faults[key] = self.faults.get(key, 0) + 1

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.__dict__)
        out["faults"] = dict(self.faults)
        return out


class FilePageStore:
    """Bounded LRU page store on a local file system.

    root:            folder shared by all namespaces (created when missing).
    namespace:       identifies what a page is: model, KV layout, dtype, page shape, rank. Pages
                     of other namespaces live in other subfolders and are refused if found here.
    capacity_bytes:  upper bound on the bytes of pages (headers included) this store keeps.
    fsync:           fsync each page before publishing it (durable across power loss, slower).
    shared:          other processes may write the same folder; `exists` then also looks on disk
                     for keys this process has not written.
    """

    def __init__(
        self,
        root: str,
        namespace: str,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        shared: bool = True,
        on_transfer: TransferObserver | None = None,
        on_store: KeyObserver | None = None,
        on_remove: KeyObserver | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.root = root
        self.namespace = namespace
        self.ns_digest = digest16(namespace)
        # one folder per namespace and page format version: pages of an older format are not met
        self.folder = os.path.join(root, self.ns_digest.hex()[:16] + (f"-v{VERSION}" if VERSION > 1 else ""))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.shared = shared
        self._tmp_prefix = f"{os.getpid():x}{uuid.uuid4().hex[:8]}"  # temporaries: this store's own names
        self._tmp_seq = itertools.count()
        self.on_transfer = on_transfer
        self.on_store = on_store
        self.on_remove = on_remove
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._used = 0
        self._reserved = 0
        self._pending: set[str] = set()
        self._scan()

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used + self._reserved

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def path_of(self, key: str) -> str:
        name = key if _SAFE_KEY.match(key) else "h-" + digest16(key).hex()
        return os.path.join(self.folder, name + SUFFIX)

    def _scan(self) -> None:
        """Adopt the pages a previous run left (oldest first) and drop stale temporaries."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            entries = []
            with os.scandir(self.folder) as it:
                for e in it:
                    if e.name.startswith(".tmp-"):
                        _unlink(e.path)
                    elif e.name.endswith(SUFFIX) and not e.name.startswith("h-"):
                        st = e.stat()
                        entries.append((st.st_mtime, e.name[: -len(SUFFIX)], st.st_size))
        except OSError as exc:
            logger.warning("kv_tiers file store %s unavailable at start (%s): every lookup is a miss", self.folder, exc)
            self.stats.fault(PageFault.IO_ERROR)
            return
        entries.sort()
        with self._lock:
            for _, key, size in entries:
                self._index[key] = size
                self._used += size
            victims = self._evict_locked(0)
        self._unlink_victims(victims)
        if entries:
            logger.info("kv_tiers file store %s: adopted %d pages (%d bytes)", self.folder, len(self._index), self._used)

    def _evict_locked(self, need: int) -> list[tuple[str, int]]:
        victims: list[tuple[str, int]] = []
        while self._index and self._used + self._reserved + need > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            victims.append((key, size))
        return victims

    def _unlink_victims(self, victims: list[tuple[str, int]]) -> None:
        for key, size in victims:
            _unlink(self.path_of(key))
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
            if self.on_remove is not None:
                self.on_remove(key)

    def _forget(self, key: str, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        if delete:
            _unlink(self.path_of(key))
        if size is not None and self.on_remove is not None:
            self.on_remove(key)

    # -- API ---------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        if not self.shared:
            return False
        try:
            size = os.stat(self.path_of(key)).st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                victims = self._evict_locked(size)
                self._index[key] = size
                self._used += size
            else:
                victims = []
        self._unlink_victims(victims)
        return True

    def prefix_hits(self, keys: list[str]) -> int:
        """Number of leading keys present (presence only; content is checked on read)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def put(self, key: str, payload: bytes | memoryview | list[memoryview]) -> bool:
        """Store a page (one buffer, or its blocks in order); True when the page is (now or already)
        in the store."""
        parts = payload_parts(payload)
        nbytes = sum(p.nbytes for p in parts)
        size = HEADER_SIZE + nbytes
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._pending:
                return False
            if size > self.capacity_bytes:
                self.stats.put_refused += 1
                self.stats.fault("too_large")
                return False
        if self.shared and self._adopt_written(key, size):
            return True
        with self._lock:
            if key in self._index:
                return True
            if key in self._pending:
                return False
            victims = self._evict_locked(size)
            self._reserved += size
            self._pending.add(key)
        self._unlink_victims(victims)
        ok = False
        t0 = time.perf_counter()
        try:
            ok = self._write(key, parts)
        finally:
            with self._lock:
                self._reserved -= size
                self._pending.discard(key)
                if ok:
                    self._index[key] = size
                    self._used += size
                    self.stats.puts += 1
                    self.stats.put_bytes += nbytes
                else:
                    self.stats.put_refused += 1
        if ok:
            if self.on_transfer is not None:
                self.on_transfer("write", nbytes, time.perf_counter() - t0)
            if self.on_store is not None:
                self.on_store(key)
        return ok

    def _adopt_written(self, key: str, size: int) -> bool:
        """Whether another instance sharing the folder already wrote this page (same size): then it is
        indexed here and not written again (two instances serving one conversation would otherwise
        write each of its pages twice). Its content is checked when it is read, as any page's."""
        try:
            if os.stat(self.path_of(key)).st_size != size:
                return False
        except OSError:
            return False
        with self._lock:
            if key in self._index:
                return True
            victims = self._evict_locked(size)
            self._index[key] = size
            self._used += size
            self.stats.put_existing += 1
        self._unlink_victims(victims)
        return True

    def _write(self, key: str, parts: list[memoryview]) -> bool:
        header = encode_header(self.ns_digest, key, parts)
        if len(parts) + 1 > _IOV_MAX:
            parts = [memoryview(b"".join(parts))]
        total = len(header) + sum(p.nbytes for p in parts)
        # unique across the processes and threads sharing the folder, without a random read per page
        tmp = os.path.join(self.folder, f".tmp-{self._tmp_prefix}-{threading.get_ident():x}-{next(self._tmp_seq)}")
        for attempt in (0, 1):
            try:
                # few system calls per page: each releases and retakes the GIL, which the scheduler's
                # thread then has to hand back (open, one gathered write, close, rename)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    n = os.writev(fd, [header, *parts])
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if n != total:
                    raise OSError(f"short write: {n} of {total} bytes")
                os.replace(tmp, self.path_of(key))
                return True
            except FileNotFoundError:
                # The folder vanished (store lost); recreate it once, then give up on this page.
                _unlink(tmp)
                if attempt == 0:
                    try:
                        os.makedirs(self.folder, exist_ok=True)
                        logger.warning("kv_tiers file store %s was missing; recreated it", self.folder)
                        continue
                    except OSError:
                        pass
                self.stats.fault(PageFault.IO_ERROR)
                return False
            except OSError as exc:
                _unlink(tmp)
                self.stats.fault("write_error")
                logger.warning("kv_tiers file store: write of %s failed (%s)", key, exc)
                return False
        return False

    def get(self, key: str, expected_len: int | None = None) -> bytes | None:
        """The page's payload, or None (a miss) when it is absent or refused."""
        t0 = time.perf_counter()
        self.stats.gets += 1
        try:
            with open(self.path_of(key), "rb") as f:
                raw = f.read()
            header = decode_header(raw)
            payload = memoryview(raw)[HEADER_SIZE:]
            check_page(header, self.ns_digest, key, payload, expected_len)
            if len(payload) != header.payload_len:
                raise PageError(PageFault.CORRUPT, "trailing bytes")
        except (PageError, OSError) as exc:
            self._refused(key, exc)
            return None
        self._served(key, header.payload_len, time.perf_counter() - t0)
        return bytes(payload)

    def get_into(self, key: str, out: memoryview | list[memoryview]) -> bool:
        """Read the page into `out` (its exact size; or its blocks in order, as a host pool holds
        them). False (a miss) when absent or refused; `out` may then hold partial data and must not
        be used."""
        t0 = time.perf_counter()
        self.stats.gets += 1
        parts = payload_parts(out)
        want = sum(p.nbytes for p in parts)
        head, spill = bytearray(HEADER_SIZE), bytearray(1)
        flat = bytearray(want) if len(parts) + 2 > _IOV_MAX else None
        try:
            # one read for header, payload and a byte past it (a longer file is not this page)
            fd = os.open(self.path_of(key), os.O_RDONLY)
            try:
                n = os.readv(fd, [head, *([flat] if flat is not None else parts), spill])
            finally:
                os.close(fd)
            header = decode_header(memoryview(head)[: max(0, min(n, HEADER_SIZE))])
            if header.payload_len == want:
                got = n - HEADER_SIZE
                if got < want:
                    raise PageError(PageFault.TRUNCATED, f"payload has {got} of {want} bytes")
                if got > want:
                    raise PageError(PageFault.CORRUPT, "trailing bytes")
            check_page(header, self.ns_digest, key, [memoryview(flat)] if flat is not None else parts, want)
            if flat is not None:
                at = 0
                for p in parts:
                    p[:] = flat[at : at + p.nbytes]
                    at += p.nbytes
        except (PageError, OSError) as exc:
            self._refused(key, exc)
            return False
        self._served(key, want, time.perf_counter() - t0)
        return True

    def remove(self, key: str) -> None:
        self._forget(key, delete=True)

    # -- sightings shared by the instances of one folder ---------------------------------------

    def note_offered(self, keys: list[str]) -> list[bool]:
        """For each key: whether some instance sharing this folder offered the page before (a
        zero-byte marker under `.seen/`); marks those not offered yet. Lets selective persistence
        count a page's second sighting when it happens on another instance. A marker is removed
        when its page is written; markers of pages never reused stay (an inode each, no data)."""
        if not self.shared:
            return [False] * len(keys)
        seen_dir = os.path.join(self.folder, ".seen")
        out = []
        for key in keys:
            path = os.path.join(seen_dir, os.path.basename(self.path_of(key)))
            for attempt in (0, 1):
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                    out.append(False)
                except FileExistsError:
                    out.append(True)
                except FileNotFoundError:
                    if attempt == 0:
                        try:
                            os.makedirs(seen_dir, exist_ok=True)
                            continue
                        except OSError:
                            pass
                    out.append(False)
                except OSError:
                    out.append(False)
                break
        return out

    def forget_offered(self, key: str) -> None:
        _unlink(os.path.join(self.folder, ".seen", os.path.basename(self.path_of(key))))

    def clear(self) -> None:
        for key in self.keys():
            self._forget(key, delete=True)

    # -- outcomes ----------------------------------------------------------------------------

    def _served(self, key: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_bytes += nbytes
        if self.on_transfer is not None:
            self.on_transfer("read", nbytes, seconds)

    def _refused(self, key: str, exc: Exception) -> None:
        self.stats.misses += 1
        if isinstance(exc, FileNotFoundError):
            self.stats.fault(PageFault.MISSING)
            self._forget(key, delete=False)
            return
        if isinstance(exc, PageError):
            fault = exc.fault
        else:
            fault = PageFault.IO_ERROR
        self.stats.fault(fault)
        logger.warning("kv_tiers file store: page %s refused (%s); recomputing it", key, exc)
        # A foreign page belongs to someone else's namespace: leave the file, stop indexing it.
        self._forget(key, delete=fault not in (PageFault.FOREIGN, PageFault.SIZE_MISMATCH, PageFault.IO_ERROR))


def calibrate_reads(make_store: Callable[[str], "FilePageStore"], page_nbytes: int, pages: int) -> int:
    """Measure a store's reads before serving: `make_store(scratch_namespace)` opens a store of the
    serving store's class on the same root (its reads reported through its `on_transfer`, as a
    served page's are); `pages` scratch pages of `page_nbytes` are written, each read back, then
    deleted with their folder. Right after the write the reads come from the page cache, as reads
    of recently written pages do. Returns the pages read back (0 when the store refused them)."""
    if pages <= 0 or page_nbytes <= 0:
        return 0
    store = make_store(f"calibration-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    payload = bytes(page_nbytes)
    read = 0
    try:
        keys = [f"calibration-{i}" for i in range(pages)]
        written = [k for k in keys if store.put(k, payload)]
        for k in written:
            read += store.get(k, page_nbytes) is not None
    finally:
        store.clear()
        try:
            os.rmdir(store.folder)
        except OSError:
            pass
    return read


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
