"""kv_tiers' staged copier as wired into SGLang's HiCache transfer (plugins/kv_tiers/sglang_adapter/copier.py)
on CUDA, on the buffers SGLang's MHA pools build (no SGLang on the GPU machine): device K/V as one
[rows, heads, dim] tensor per layer, the host pool pinned [2, pages, layers, page_size, heads, dim]
(page_first_direct). The hooks' backup / load run on a side stream without waiting (as HiCache's
write and load streams do); the data must be exact once that stream is synchronized."""
from __future__ import annotations

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.sglang_adapter import copier as sc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class MHATokenToKVPoolHost:  # SGLang's plain MHA host pool as far as the hooks read it
    def __init__(self, layers: int, dev_pages: int, host_pages: int, ps: int, heads: int, dim: int,
                 pinned: bool) -> None:
        dev = torch.device("cuda")
        self.layout, self.page_size = "page_first_direct", ps
        self.layer_num = self.target_layer_num = layers
        self.head_dim = self.v_head_dim = dim
        self.device_k_buffers = tuple(torch.randn(dev_pages * ps + ps, heads, dim, device=dev).to(torch.bfloat16)
                                      for _ in range(layers))
        self.device_v_buffers = tuple(torch.randn(dev_pages * ps + ps, heads, dim, device=dev).to(torch.bfloat16)
                                      for _ in range(layers))
        self.kv_buffer = torch.zeros(2, host_pages, layers, ps, heads, dim, dtype=torch.bfloat16, pin_memory=pinned)
        self.heads = heads

    def get_size_per_token(self) -> int:  # SGLang's formula: K and V of every layer
        return (self.head_dim + self.v_head_dim) * self.heads * self.layer_num * self.kv_buffer.element_size()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]


def _tokens(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


@pytest.mark.parametrize("pinned", [True, False])
def test_hooked_transfer_is_exact_on_cuda_with_sglang_buffers(pinned: bool) -> None:
    layers, dev_pages, host_pages, ps, heads, dim, n = 8, 3000, 4000, 16, 8, 128, 2500
    pool = MHATokenToKVPoolHost(layers, dev_pages, host_pages, ps, heads, dim, pinned)
    assert sc.eligible(pool, "direct")
    dp = torch.randperm(dev_pages)[:n]
    # host pages: long runs with gaps, as HiCache's allocator hands them out
    hp = torch.cat([torch.arange(0, 1000), torch.arange(1500, 2400), torch.arange(3000, 3600)])[:n]
    hi, di = _tokens(hp, ps), _tokens(dp, ps).cuda()
    sc._copiers.clear()
    side = torch.cuda.Stream()
    for _ in range(2):  # staging buffers reused across calls
        with torch.cuda.stream(side):
            sc.backup(pool, hi, di, chunk_pages=333)
        side.synchronize()
        for part, bufs in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
            want = torch.stack([b[di].view(n, ps, heads, dim) for b in bufs], dim=1).cpu()
            assert torch.equal(pool.kv_buffer[part][hp], want)
        pool.kv_buffer[:, hp] = torch.randn(2, n, layers, ps, heads, dim).to(torch.bfloat16)
        target = torch.randperm(dev_pages)[:n]
        ti = _tokens(target, ps).cuda()
        with torch.cuda.stream(side):
            sc.load(pool, hi, ti, chunk_pages=333)
        side.synchronize()
        for part, bufs in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
            got = torch.stack([b[ti].view(n, ps, heads, dim) for b in bufs], dim=1).cpu()
            assert torch.equal(got, pool.kv_buffer[part][hp])


def test_backup_is_timed_on_the_device(monkeypatch) -> None:
    """The hook's L1->L2 backup, issued on a side stream without waiting (as HiCache does), is timed by
    CUDA events and read at the next backup, once complete: the tier state's device time and tokens
    give a bandwidth a PCIe copy can have (the wall time of the call would time only the issuing)."""
    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
    from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    tiers = TierState(KvTiersConfig(), "gpu-test")
    monkeypatch.setattr(state, "_tiers", tiers)
    monkeypatch.setattr(sc, "_enabled", lambda: (True, 256))
    layers, dev_pages, host_pages, ps, heads, dim, n = 8, 3000, 4000, 16, 8, 128, 2500
    pool = MHATokenToKVPoolHost(layers, dev_pages, host_pages, ps, heads, dim, pinned=True)
    hi = _tokens(torch.arange(n), ps)
    di = _tokens(torch.randperm(dev_pages)[:n], ps).cuda()
    sc._copiers.clear()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up: the copier's first call builds (and Triton compiles) its kernels
        sc.around_backup_from_device_all_layer(lambda *a, **k: "sglang", pool, None, hi, di, "direct")
    side.synchronize()
    sc._backup_timings.ready()  # the warm-up's pair (and anything left from another test) dropped
    tiers = TierState(KvTiersConfig(), "gpu-test")
    monkeypatch.setattr(state, "_tiers", tiers)
    for _ in range(2):  # the second call reads the first one's events
        with torch.cuda.stream(side):
            assert sc.around_backup_from_device_all_layer(lambda *a, **k: "sglang", pool, None, hi, di, "direct") is None
        side.synchronize()
    assert tiers.counts["l2_backup_device_tokens"] == hi.numel() and tiers.path_calls["l2_backup_device"] == 1
    gbps = 2 * layers * n * ps * heads * dim * 2 / tiers.path_s["l2_backup_device"] / 1e9
    assert tiers.counts["l2_backup_device_bytes"] == 2 * layers * n * ps * heads * dim * 2
    print(f"L1->L2 backup timed on the device: {gbps:.1f} GB/s ({tiers.counts['l2_backup_device_bytes']} bytes)")
    assert 1.0 < gbps < 200.0, gbps


def test_backup_with_device_indices_kept_on_the_gpu_does_not_wait_for_the_forward(monkeypatch) -> None:
    """HiCache's write on the scheduler's thread while a forward pass runs (a device sleep on the
    scheduler's stream): with SGLang's direct-backend move (`device_indices.cpu()`) the call waits
    for that pass; with around_move_indices keeping them on the GPU it returns at once, and the pages
    still land exactly once the write stream (which waits for the scheduler's stream) is done."""
    import time
    from types import SimpleNamespace

    from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
    from kllm_plugins.plugins.kv_tiers.sglang_adapter import state

    monkeypatch.setattr(state, "_tiers", None)
    monkeypatch.setattr(sc, "_enabled", lambda: (True, 256))
    layers, dev_pages, host_pages, ps, heads, dim, n = 8, 3000, 4000, 16, 8, 128, 1000
    pool = MHATokenToKVPoolHost(layers, dev_pages, host_pages, ps, heads, dim, pinned=True)
    ctl = SimpleNamespace(io_backend="direct", mem_pool_host=pool)
    hp = torch.arange(n)
    hi, di = _tokens(hp, ps), _tokens(torch.randperm(dev_pages)[:n], ps).cuda()

    def sglang_move(self, host, dev):  # HiCacheController.move_indices, direct backend, page_first_direct
        return host, dev.cpu()

    sc._copiers.clear()
    sc.backup(pool, hi, di, chunk_pages=256, sync=True)  # warm-up: kernels built (and compiled)
    main, write = torch.cuda.current_stream(), torch.cuda.Stream()
    cycles = 400_000_000
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    forward_s = time.perf_counter() - t0

    def write_while_forward_runs(keep: bool) -> float:
        monkeypatch.setattr(sc, "_config", lambda: KvTiersConfig(device_indices_on_gpu=keep))
        pool.kv_buffer.zero_()
        torch.cuda._sleep(cycles)  # the forward pass in flight
        t0 = time.perf_counter()
        host, dev = sc.around_move_indices(sglang_move, ctl, hi, di)
        assert dev.is_cuda is keep
        write.wait_stream(main)
        with torch.cuda.stream(write):
            assert sc.around_backup_from_device_all_layer(lambda *a, **k: "sglang", pool, None, host, dev,
                                                          "direct") is None
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
        for part, bufs in ((0, pool.device_k_buffers), (1, pool.device_v_buffers)):
            want = torch.stack([b[di].view(n, ps, heads, dim) for b in bufs], dim=1).cpu()
            assert torch.equal(pool.kv_buffer[part][hp], want)
        return wall

    moved, kept = write_while_forward_runs(False), write_while_forward_runs(True)
    print(f"forward {forward_s * 1e3:.0f} ms; HiCache write call: indices moved to the host "
          f"{moved * 1e3:.1f} ms, kept on the GPU {kept * 1e3:.1f} ms")
    assert moved > 0.8 * forward_s and kept < 0.25 * forward_s, (forward_s, moved, kept)


def test_high_priority_gather_sees_the_callers_queued_writes_and_is_exact() -> None:
    """With `gather_priority` the gather runs on a stream of its own: it must still come after what
    the caller queued (a forward writing the KV) and the caller's stream after the copies."""
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    layers, dev_pages, ps, heads, dim, n = 8, 3000, 16, 8, 128, 2500
    pool = MHATokenToKVPoolHost(layers, dev_pages, 2 * n, ps, heads, dim, pinned=True)
    cp = LayerListCopier(torch.device("cuda"), layers, ps * heads * dim, torch.bfloat16, chunk_pages=333,
                         gather_priority=-1)
    assert cp.staged._gather_stream is not None
    dp, hp = torch.randperm(dev_pages)[:n].cuda(), torch.arange(n)
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    for value in (1.0, 2.0):
        with torch.cuda.stream(side):
            for _ in range(20):  # a long kernel queue ahead of the writes on the caller's stream
                a = torch.tanh(a @ a)
            for b in pool.device_k_buffers:
                b.fill_(value)
            cp.to_host(pool.device_k_buffers, pool.k_buffer, dp, hp, ps, sync=False)
            pool.device_k_buffers[0].fill_(-1.0)  # after the copy on the caller's stream: not seen
        side.synchronize()
        assert bool((pool.k_buffer[hp] == value).all())


def test_shuffled_host_pages_are_merged_into_runs_and_exact() -> None:
    """A free list can hand a transfer consecutive host pages in shuffled order: the copier sorts the
    pairs by host page (one copy per run, not per page) and the data stays exact both ways."""
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    layers, dev_pages, ps, heads, dim, n = 8, 3000, 16, 8, 128, 2500
    pool = MHATokenToKVPoolHost(layers, dev_pages, 2 * n, ps, heads, dim, pinned=True)
    cp = LayerListCopier(torch.device("cuda"), layers, ps * heads * dim, torch.bfloat16, chunk_pages=333)
    dp = torch.randperm(dev_pages)[:n].cuda()
    hp = (torch.arange(n) + 7)[torch.randperm(n)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        cp.to_host(pool.device_k_buffers, pool.k_buffer, dp, hp, ps, sync=False)
    side.synchronize()
    assert cp.copies["to_host"] <= 2 * ((n + 332) // 333)  # a run per chunk, not a copy per page
    want = torch.stack([b[_tokens(dp.cpu(), ps).cuda()].view(n, ps, heads, dim) for b in pool.device_k_buffers], 1)
    assert torch.equal(pool.k_buffer[hp], want.cpu())
    pool.k_buffer[hp] = torch.randn(n, layers, ps, heads, dim).to(torch.bfloat16)
    target = torch.randperm(dev_pages)[:n].cuda()
    with torch.cuda.stream(side):
        cp.to_device(pool.k_buffer, hp, pool.device_k_buffers, target, ps, sync=False)
    side.synchronize()
    got = torch.stack([b[_tokens(target.cpu(), ps).cuda()].view(n, ps, heads, dim) for b in pool.device_k_buffers], 1)
    assert torch.equal(got.cpu(), pool.k_buffer[hp])
