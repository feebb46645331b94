"""kv_tiers' staged copier on SGLang's HiCache transfer path (plugins/kv_tiers/sglang_adapter/copier.py),
on the CPU: the hooks leave the CPU platform's own transfer alone, take CUDA-eligible pools only,
and, when taken, move the same bytes SGLang's `direct` page_first_direct transfer moves. The real
thing on CUDA: tests/gpu/test_kv_tiers_copier_sglang_gpu.py."""
from __future__ import annotations

import inspect

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.sglang_adapter import copier as sc

pytestmark = pytest.mark.sglang

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8


class MHATokenToKVPoolHost:  # the hooks take SGLang's plain MHA host pool only (matched by class name)
    """SGLang's MHA host pool as far as the hooks read it, with its buffers' shapes."""

    def __init__(self, dev_pages: int = 20, host_pages: int = 24) -> None:
        g = torch.Generator().manual_seed(5)
        self.layout, self.page_size = "page_first_direct", PS
        self.layer_num = self.target_layer_num = LAYERS
        self.head_dim = self.v_head_dim = DIM
        self.device_k_buffers = tuple(torch.randn(dev_pages * PS + PS, HEADS, DIM, generator=g) for _ in range(LAYERS))
        self.device_v_buffers = tuple(torch.randn(dev_pages * PS + PS, HEADS, DIM, generator=g) for _ in range(LAYERS))
        self.kv_buffer = torch.zeros(2, host_pages, LAYERS, PS, HEADS, DIM)

    def get_size_per_token(self) -> int:  # SGLang's formula: K and V of every layer
        return (self.head_dim + self.v_head_dim) * HEADS * self.layer_num * self.kv_buffer.element_size()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]


def _tokens(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PS + i for p in pages for i in range(PS)])


class _Original:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return "sglang"


def test_hooks_read_only_what_sglang_pool_has() -> None:
    from sglang.srt.mem_cache.pool_host import base, mha

    src = inspect.getsource(mha.MHATokenToKVPoolHost)
    for attr in ("self.device_k_buffers =", "self.device_v_buffers =", "self.target_layer_num =",
                 "self.layer_num =", "self.head_dim =", "self.v_head_dim =", "def k_buffer", "def v_buffer"):
        assert attr in src, attr
    base_src = inspect.getsource(base.HostKVCache)
    assert "self.layout =" in base_src and "self.page_size =" in base_src
    # page_first_direct host buffers are [2, pages, layers, page_size, heads, dim]: a page is contiguous
    assert '"page_first_direct"' in src and "self.page_num,\n                self.layer_num,\n                self.page_size," in src
    sig = inspect.signature(mha.MHATokenToKVPoolHost.load_to_device_per_layer)
    assert list(sig.parameters)[:6] == ["self", "device_pool", "host_indices", "device_indices", "layer_id",
                                        "io_backend"]
    sig = inspect.signature(mha.MHATokenToKVPoolHost.backup_from_device_all_layer)
    assert list(sig.parameters) == ["self", "device_pool", "host_indices", "device_indices", "io_backend"]


def test_cpu_pools_keep_sglang_transfer(monkeypatch) -> None:
    monkeypatch.setattr(sc, "_enabled", lambda: (True, 8))
    pool, orig = MHATokenToKVPoolHost(), _Original()
    assert not sc.eligible(pool, "direct")  # CPU tensors: the platform's own path
    assert sc.around_backup_from_device_all_layer(orig, pool, None, _tokens([1]), _tokens([2]), "direct") == "sglang"
    assert sc.around_load_to_device_per_layer(orig, pool, None, _tokens([1]), _tokens([2]), 0, "direct") == "sglang"
    assert orig.calls == 2 and not pool.kv_buffer.any()
    # what a CUDA pool would take, and what it would not
    assert sc.eligible(pool, "direct", device_type="cuda")
    assert not sc.eligible(pool, "kernel", device_type="cuda")
    pool.layout = "layer_first"
    assert not sc.eligible(pool, "direct", device_type="cuda")
    pool.layout, pool.layer_num = "page_first_direct", LAYERS + 1  # draft layers
    assert not sc.eligible(pool, "direct", device_type="cuda")


def test_disabled_copier_keeps_sglang_transfer(monkeypatch) -> None:
    monkeypatch.setattr(sc, "_enabled", lambda: (False, 8))
    monkeypatch.setattr(sc, "eligible", lambda pool, io, device_type=None: True)
    pool, orig = MHATokenToKVPoolHost(), _Original()
    assert sc.around_backup_from_device_all_layer(orig, pool, None, _tokens([1]), _tokens([2]), "direct") == "sglang"
    assert orig.calls == 1


@pytest.mark.parametrize("host_pages", [[0, 1, 2, 9, 23], [2, 23, 0, 9, 1]])  # in order; shuffled (reordered once)
def test_taken_hooks_move_what_sglang_direct_transfer_moves(monkeypatch, host_pages: list[int]) -> None:
    """Eligibility forced on CPU tensors: the hooks run the copier (its synchronous CPU path) and
    the host pool ends up as SGLang's page_first_direct transfer (the CPU platform's torch op)
    leaves it; the load brings every layer back at layer 0 and ignores the later layers' calls."""
    from kllm_plugins.hardware.cpu.kv_direct_copy import transfer_kv_all_layer_direct_lf_pf

    monkeypatch.setattr(sc, "_enabled", lambda: (True, 2))
    monkeypatch.setattr(sc, "eligible", lambda pool, io, device_type=None: io == "direct")
    pool, ref, orig = MHATokenToKVPoolHost(), MHATokenToKVPoolHost(), _Original()
    dev_pages = [7, 2, 3, 11, 19]
    di, hi = _tokens(dev_pages), _tokens(host_pages)
    sc._copiers.clear()
    assert sc.around_backup_from_device_all_layer(orig, pool, None, hi, di, "direct") is None
    transfer_kv_all_layer_direct_lf_pf(ref.device_k_buffers + ref.device_v_buffers, [ref.k_buffer, ref.v_buffer],
                                       di, hi, PS)
    assert orig.calls == 0 and pool.kv_buffer.any()
    assert torch.equal(pool.kv_buffer, ref.kv_buffer)
    assert sc._copiers[id(pool)].calls["to_host"] == 2  # K and V
    # load back into other device pages
    target = _tokens([0, 1, 4, 5, 6])
    for k in range(LAYERS):
        assert sc.around_load_to_device_per_layer(orig, pool, None, hi, target, k, "direct") is None
    assert sc._copiers[id(pool)].calls["to_device"] == 2  # once, at layer 0, for K and V
    for layer in range(LAYERS):
        for part, bufs in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
            got = bufs[layer][target].view(len(host_pages), PS, HEADS, DIM)
            assert torch.equal(got, pool.kv_buffer[part][host_pages, layer])
    # draft calls and other backends go to SGLang
    assert sc.around_load_to_device_per_layer(orig, pool, None, hi, target, 0, "direct", is_draft=True) == "sglang"
    assert sc.around_backup_from_device_all_layer(orig, pool, None, hi, di, "kernel") == "sglang"


@pytest.mark.parametrize("where", ["indices_on_gpu", "pool_on_gpu"])
def test_backups_on_a_gpu_are_timed_by_events_read_at_a_later_call(monkeypatch, where: str) -> None:
    """The adapter's bookkeeping of device timings (CUDA events stood in for on the CPU): a backup
    whose device indices are on a GPU, or whose device pool is (SGLang's `direct` I/O backend moves
    the device indices to the host first), records a start and an end event; the pair is read at
    the next backup once complete, into the tier state's device time and tokens. Without a tier
    state nothing is recorded."""
    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
    from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    class Ev:
        clock_ms = 0.0

        def __init__(self) -> None:
            Ev.clock_ms += 2.5
            self.t_ms = Ev.clock_ms

        def query(self) -> bool:  # complete once a later event exists (the device ran on)
            return self is not made[-1]

        def elapsed_time(self, end: "Ev") -> float:
            return end.t_ms - self.t_ms

    class OnGpu:  # device indices as far as the hook reads them
        is_cuda = True

        def cpu(self) -> "OnGpu":  # SGLang's own copy takes them on the host
            return self

    class DevicePool:
        device = "cuda"

    dev_pool, dev_idx = (None, OnGpu()) if where == "indices_on_gpu" else (DevicePool(), torch.tensor([0, 1]))

    made: list[Ev] = []
    monkeypatch.setattr(sc, "_cuda_event", lambda: made.append(Ev()) or made[-1])
    monkeypatch.setattr(sc, "_enabled", lambda: (False, 2))
    monkeypatch.setattr(sc, "_backup_timings", type(sc._backup_timings)())  # nothing left from another test
    orig, hi = _Original(), _tokens([1, 2])
    monkeypatch.setattr(state, "_tiers", None)
    sc.around_backup_from_device_all_layer(orig, MHATokenToKVPoolHost(), dev_pool, hi, dev_idx, "direct")
    assert made == [] and len(sc._backup_timings) == 0
    tiers = TierState(KvTiersConfig(), "cpu-test")
    monkeypatch.setattr(state, "_tiers", tiers)
    for _ in range(2):
        assert sc.around_backup_from_device_all_layer(orig, MHATokenToKVPoolHost(), dev_pool, hi, dev_idx,
                                                      "direct") == "sglang"
    assert len(made) == 4 and orig.calls == 3
    # the first backup's pair was read at the second; the second's waits for the next call
    assert tiers.counts["l2_backup_device_tokens"] == hi.numel() and tiers.path_calls["l2_backup_device"] == 1
    assert tiers.path_s["l2_backup_device"] == pytest.approx(0.0025) and len(sc._backup_timings) == 1
    assert tiers.counts["l2_backup_tokens"] == 2 * hi.numel()
    per_token = MHATokenToKVPoolHost().get_size_per_token()
    assert per_token > 0 and tiers.counts["l2_backup_device_bytes"] == hi.numel() * per_token
    # the same call in its size class
    size = sc.backup_size_class(hi.numel() * per_token)
    assert tiers.counts[f"l2_backup_calls_{size}"] == 1 and tiers.counts[f"l2_backup_us_{size}"] == 2500
    assert tiers.counts[f"l2_backup_bytes_{size}"] == hi.numel() * per_token
    assert [sc.backup_size_class(n) for n in (1, 64 << 20, 600 << 20)] == ["small", "medium", "large"]


def test_sglang_direct_backend_moves_device_indices_to_the_host() -> None:
    """What around_move_indices rests on: SGLang's `direct` backend copies a transfer's device indices
    to the host (`.cpu()`, a copy that waits for the stream's work) for the page_first_direct layout,
    and its transfer engine orders device-side indices on its own streams (an event recorded on the
    caller's stream before the indices are read; record_stream on CUDA indices)."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache import l2_transfer

    src = inspect.getsource(HiCacheController.move_indices)
    assert 'layout == "page_first_direct":\n                return host_indices, device_indices.cpu()' in src
    assert list(inspect.signature(HiCacheController.move_indices).parameters) == ["self", "host_indices",
                                                                                  "device_indices"]
    # the UnifiedRadixCache's controller moves each host pool of its group through move_indices
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    assert "return self.move_indices(host_indices, device_indices)" in inspect.getsource(
        HybridCacheController._move_pool_indices)
    assert "self.entry_map = {entry.name: entry" in inspect.getsource(HostPoolGroup.__init__)
    assert "host_pool" in PoolEntry.__dataclass_fields__
    sub = inspect.getsource(l2_transfer.L2TransferEngine._submission)
    assert "start_event.wait(stream)" in sub and "_record_stream(" in sub
    assert "indices.record_stream(stream)" in inspect.getsource(l2_transfer.L2TransferEngine._record_stream)


class _Indices:
    """Device indices as far as the hooks read them."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self.moved = 0

    def cpu(self) -> str:
        self.moved += 1
        return "on host"


class _Entry:
    def __init__(self, host_pool) -> None:
        self.host_pool = host_pool


class _Group:  # SGLang's HostPoolGroup as far as the hook reads it (what HybridCacheController holds)
    def __init__(self, *pools) -> None:
        self.entry_map = {f"pool{i}": _Entry(p) for i, p in enumerate(pools)}


class _Controller:
    def __init__(self, io_backend: str = "direct", host=None) -> None:
        self.io_backend, self.mem_pool_host = io_backend, MHATokenToKVPoolHost() if host is None else host


def test_move_indices_leaves_device_indices_on_the_gpu_where_the_copier_takes_them(monkeypatch) -> None:
    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
    from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    def original(self, host, dev):
        return host, dev.cpu()

    cfg = {"c": KvTiersConfig()}
    monkeypatch.setattr(sc, "_config", lambda: cfg["c"])
    monkeypatch.setattr(sc, "eligible", lambda pool, io, device_type=None: io == "direct" and pool is not None)
    tiers = TierState(KvTiersConfig(), "cpu-test")
    monkeypatch.setattr(state, "_tiers", tiers)
    host = _tokens([1, 2])
    dev = _Indices(is_cuda=True)
    assert sc.around_move_indices(original, _Controller(), host, dev) == (host, dev)
    assert dev.moved == 0 and tiers.counts["l2_index_host_copies_skipped"] == 1
    # the UnifiedRadixCache's controller holds a group of host pools: every one must take the copier
    assert sc.around_move_indices(original, _Controller(host=_Group(MHATokenToKVPoolHost())), host, dev) == (host, dev)
    assert tiers.counts["l2_index_host_copies_skipped"] == 2
    assert sc.around_move_indices(original, _Controller(host=_Group(MHATokenToKVPoolHost(), None)), host,
                                  dev) == (host, "on host")
    assert sc.around_move_indices(original, _Controller(host=_Group()), host, dev) == (host, "on host")
    dev.moved = 0
    # SGLang's own move: another backend, host-side indices, no host pool, the option or the copier off
    assert sc.around_move_indices(original, _Controller("kernel"), host, dev) == (host, "on host")
    assert sc.around_move_indices(original, _Controller(), host, _Indices(is_cuda=False)) == (host, "on host")
    ctl = _Controller()
    ctl.mem_pool_host = None
    assert sc.around_move_indices(original, ctl, host, dev) == (host, "on host")
    for off in ({"device_indices_on_gpu": False}, {"staged_copier": False}):
        cfg["c"] = KvTiersConfig(**off)
        assert sc.around_move_indices(original, _Controller(), host, dev) == (host, "on host")
    cfg["c"] = None  # plugin not enabled in this process
    assert sc.around_move_indices(original, _Controller(), host, dev) == (host, "on host")
    assert dev.moved == 5 and tiers.counts["l2_index_host_copies_skipped"] == 2


def test_sglang_copy_after_a_skipped_move_gets_host_indices(monkeypatch) -> None:
    """Where the indices stayed on the GPU but the copier then steps aside (a draft call, extra
    arguments), SGLang's direct copy gets them on the host as it would have; other backends as given."""
    monkeypatch.setattr(sc, "_enabled", lambda: (True, 8))
    monkeypatch.setattr(sc, "eligible", lambda pool, io, device_type=None: io == "direct")
    seen = []

    def original(self, device_pool, host, dev, *rest, **kw):
        seen.append(dev)
        return "sglang"

    pool, host = MHATokenToKVPoolHost(), _tokens([1])
    assert sc.around_load_to_device_per_layer(original, pool, None, host, _Indices(True), 0, "direct",
                                              is_draft=True) == "sglang"
    assert sc.around_backup_from_device_all_layer(original, pool, None, host, _Indices(True), "direct",
                                                  "extra") == "sglang"
    kernel_idx = _Indices(True)
    assert sc.around_backup_from_device_all_layer(original, pool, None, host, kernel_idx, "kernel") == "sglang"
    assert seen == ["on host", "on host", kernel_idx]


def test_move_indices_reads_sglangs_own_host_pool_group(monkeypatch) -> None:
    """The group the UnifiedRadixCache's controller holds, built by SGLang's own HostPoolGroup: the
    hook finds the MHA host pool in it (the first in-server run missed it by reading the group as a
    pool), and a group with a pool the copier does not take keeps SGLang's move."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    def pool(eligible: bool) -> MHATokenToKVPoolHost:
        p = MHATokenToKVPoolHost()
        p.device, p.size, p.logical_size, p.can_use_write_back_jit = "cpu", 96, 96, False
        p.eligible = eligible
        return p

    def group(*pools: MHATokenToKVPoolHost) -> HostPoolGroup:
        kinds = list(PoolName)
        return HostPoolGroup([PoolEntry(name=kinds[i], host_pool=p, device_pool=None, layer_mapper=lambda k: k)
                              for i, p in enumerate(pools)])

    monkeypatch.setattr(sc, "_config", lambda: KvTiersConfig())
    monkeypatch.setattr(sc, "eligible", lambda p, io, device_type=None: io == "direct" and getattr(p, "eligible", False))
    monkeypatch.setattr(state, "_tiers", None)

    def original(self, host, dev):
        return host, dev.cpu()

    host, dev = _tokens([3]), _Indices(is_cuda=True)
    assert sc.around_move_indices(original, _Controller(host=group(pool(True))), host, dev) == (host, dev)
    assert sc.around_move_indices(original, _Controller(host=group(pool(True), pool(False))), host,
                                  dev) == (host, "on host")
