"""kv_tiers' staged L1<->L2 page copier (core/staged_copy.py) on the CPU: the logic of gather,
chunking and scatter for both pool layouts, against plain indexing."""
from __future__ import annotations

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.core.staged_copy import StagedCopier, page_shape


def _pools(pages: int, layers: int, elems: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"page_first": torch.randn(pages, layers * elems, generator=g),
            "layer_first": torch.randn(layers, pages, elems, generator=g)}


def _pages_of(pool: torch.Tensor, layout: str, idx: torch.Tensor) -> torch.Tensor:
    if layout == "page_first":
        return pool[idx]
    return pool[:, idx].transpose(0, 1).reshape(len(idx), -1)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_round_trip_matches_indexing(layout: str, chunk: int) -> None:
    pool = _pools(40, 4, 6)[layout]
    idx = torch.randperm(40, generator=torch.Generator().manual_seed(chunk))[:19]
    cp = StagedCopier(torch.device("cpu"), 24, torch.float32, chunk_pages=chunk)
    host = torch.empty(19, 24)
    cp.to_host(pool, layout, idx, host)
    assert torch.equal(host, _pages_of(pool, layout, idx))
    untouched = [p for p in range(40) if p not in set(idx.tolist())]
    before = _pages_of(pool, layout, torch.tensor(untouched)).clone()
    new = torch.randn(19, 24)
    cp.to_device(new, pool, layout, idx)
    assert torch.equal(_pages_of(pool, layout, idx), new)
    assert torch.equal(_pages_of(pool, layout, torch.tensor(untouched)), before)  # only those pages written


def test_shapes_and_types_are_checked() -> None:
    cp = StagedCopier(torch.device("cpu"), 24, torch.float32)
    pool = torch.zeros(10, 24)
    with pytest.raises(ValueError, match="host buffer"):
        cp.to_host(pool, "page_first", torch.arange(3), torch.empty(4, 24))
    with pytest.raises(ValueError, match="elements"):
        cp.to_host(torch.zeros(10, 12), "page_first", torch.arange(3), torch.empty(3, 24))
    with pytest.raises(ValueError, match="layer_first pool"):
        page_shape(pool, "layer_first")
    with pytest.raises(ValueError, match="chunk_pages"):
        StagedCopier(torch.device("cpu"), 24, torch.float32, chunk_pages=0)
    assert page_shape(torch.zeros(3, 10, 8), "layer_first") == (10, 24)


# -- SGLang's HiCache shapes: per-layer device tensors, page_first_direct host pool -------------

def _sglang_pools(layers: int = 3, dev_pages: int = 40, host_pages: int = 50, ps: int = 4, heads: int = 2,
                  dim: int = 8) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # MHATokenToKVPool: one [size + page_size, heads, dim] tensor per layer
    dev = [torch.randn(dev_pages * ps + ps, heads, dim, generator=g) for _ in range(layers)]
    # MHATokenToKVPoolHost, page_first_direct: [pages, layers, page_size, heads, dim]
    host = torch.randn(host_pages, layers, ps, heads, dim, generator=g)
    return dev, host


def _tokens(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + i for p in pages for i in range(ps)])


def test_page_ids_and_runs() -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import page_ids, runs

    assert page_ids(_tokens([5, 6, 9], 4), 4).tolist() == [5, 6, 9]
    with pytest.raises(ValueError):
        page_ids(torch.tensor([1, 2, 3, 4]), 4)  # not page-aligned
    with pytest.raises(ValueError):
        page_ids(torch.tensor([0, 1, 2]), 4)  # not whole pages
    assert runs(torch.tensor([7, 8, 9, 3, 4, 12])) == [(0, 7, 3), (3, 3, 2), (5, 12, 1)]
    assert runs(torch.tensor([], dtype=torch.long)) == []


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_layer_list_copier_moves_whole_pages_both_ways(chunk: int) -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    ps, layers = 4, 3
    dev, host = _sglang_pools(layers=layers, ps=ps)
    cp = LayerListCopier("cpu", layers, ps * 2 * 8, torch.float32, chunk_pages=chunk)
    dev_pages = torch.tensor([3, 17, 4, 30, 31, 0, 9])
    host_pages = torch.tensor([10, 11, 12, 40, 2, 3, 49])  # runs of consecutive host pages and singles
    before = host.clone()
    cp.to_host(dev, host, dev_pages, host_pages, ps)
    for d, h in zip(dev_pages.tolist(), host_pages.tolist()):
        for layer in range(layers):
            assert torch.equal(host[h, layer], dev[layer][d * ps:(d + 1) * ps])
    untouched = [p for p in range(host.shape[0]) if p not in host_pages.tolist()]
    assert torch.equal(host[untouched], before[untouched])
    # back: fresh host content into other device pages
    host[host_pages] = torch.randn(len(host_pages), layers, ps, 2, 8)
    target = torch.tensor([1, 2, 5, 6, 7, 8, 39])
    dev_before = [x.clone() for x in dev]
    cp.to_device(host, host_pages, dev, target, ps)
    for d, h in zip(target.tolist(), host_pages.tolist()):
        for layer in range(layers):
            assert torch.equal(dev[layer][d * ps:(d + 1) * ps], host[h, layer])
    others = [r for r in range(dev[0].shape[0]) if r // ps not in target.tolist()]
    assert all(torch.equal(x[others], y[others]) for x, y in zip(dev, dev_before))


def test_host_order_merges_runs_and_keeps_every_pair() -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import host_order, runs

    dev = torch.tensor([30, 31, 5, 6, 9, 2])
    hl = [12, 10, 11, 21, 13, 20]  # two ranges handed out interleaved: 5 runs as given
    d2, h2 = host_order(dev, hl)
    assert h2 == [10, 11, 12, 13, 20, 21] and len(runs(h2)) == 2 and len(runs(hl)) == 5
    assert sorted(zip(d2.tolist(), h2)) == sorted(zip(dev.tolist(), hl))  # same pairs
    # nothing to gain: given back as they came (no device work)
    for same in ([1, 2, 3, 9], [10, 11, 12, 40, 2, 3, 49], [7]):
        d3, h3 = host_order(dev[:len(same)], same)
        assert h3 is same and d3 is not None and torch.equal(d3, dev[:len(same)])


@pytest.mark.parametrize("merge", [True, False])
def test_layer_list_copier_is_exact_with_shuffled_host_pages(merge: bool) -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    ps, layers = 4, 3
    dev, host = _sglang_pools(layers=layers, ps=ps)
    cp = LayerListCopier("cpu", layers, ps * 2 * 8, torch.float32, chunk_pages=3, merge_host_runs=merge)
    dev_pages = torch.tensor([3, 17, 4, 30, 31, 0, 9])
    host_pages = torch.tensor([22, 20, 24, 21, 23, 26, 25])
    cp.to_host(dev, host, dev_pages, host_pages, ps)
    for d, h in zip(dev_pages.tolist(), host_pages.tolist()):
        for layer in range(layers):
            assert torch.equal(host[h, layer], dev[layer][d * ps:(d + 1) * ps])
    host[host_pages] = torch.randn(len(host_pages), layers, ps, 2, 8)
    target = torch.tensor([1, 2, 5, 6, 7, 8, 39])
    cp.to_device(host, host_pages, dev, target, ps)
    for d, h in zip(target.tolist(), host_pages.tolist()):
        for layer in range(layers):
            assert torch.equal(dev[layer][d * ps:(d + 1) * ps], host[h, layer])


def test_a_plan_serves_k_and_v_without_ordering_the_pages_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from kllm_plugins.plugins.kv_tiers.core import staged_copy

    ps, layers = 4, 3
    k, hk = _sglang_pools(layers=layers, ps=ps)
    v, hv = _sglang_pools(layers=layers, ps=ps)
    cp = staged_copy.LayerListCopier("cpu", layers, ps * 2 * 8, torch.float32, chunk_pages=3)
    calls = []
    real = staged_copy.host_order
    monkeypatch.setattr(staged_copy, "host_order", lambda d, h: calls.append(1) or real(d, h))
    dev_pages, host_pages = torch.tensor([3, 17, 4, 30, 31]), torch.tensor([22, 20, 24, 21, 23])
    dp, hl = cp.plan(dev_pages, host_pages)
    assert hl == [20, 21, 22, 23, 24] and calls == [1]
    for layer_list, host in ((k, hk), (v, hv)):
        cp.to_host(layer_list, host, dp, hl, ps)
        for d, h in zip(dev_pages.tolist(), host_pages.tolist()):
            for layer in range(layers):
                assert torch.equal(host[h, layer], layer_list[layer][d * ps:(d + 1) * ps])
    assert calls == [1]  # the planned pages were taken as they are
    target = torch.tensor([1, 2, 5, 6, 7])
    tp, thl = cp.plan(target, host_pages)
    for layer_list, host in ((k, hk), (v, hv)):
        cp.to_device(host, thl, layer_list, tp, ps)
        for d, h in zip(target.tolist(), host_pages.tolist()):
            for layer in range(layers):
                assert torch.equal(layer_list[layer][d * ps:(d + 1) * ps], host[h, layer])
    assert calls == [1, 1]


def test_layer_list_copier_refuses_mismatched_pools() -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    dev, host = _sglang_pools(layers=3, ps=4)
    with pytest.raises(ValueError):
        LayerListCopier("cpu", 2, 4 * 16, torch.float32).to_host(dev, host, torch.tensor([0]), torch.tensor([0]), 4)
    with pytest.raises(ValueError):
        LayerListCopier("cpu", 3, 4 * 16, torch.float32).to_host(dev, host.to(torch.bfloat16), torch.tensor([0]),
                                                               torch.tensor([0]), 4)


def test_auto_kernel_is_torch_off_cuda_and_kernel_is_checked() -> None:
    from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

    assert LayerListCopier("cpu", 3, 16, torch.float32).kernel == "torch"
    with pytest.raises(ValueError, match="kernel"):
        LayerListCopier("cpu", 3, 16, torch.float32, kernel="cuda")  # type: ignore[arg-type]


TRITON_SCRIPT = """
import torch
from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier
from kllm_plugins.plugins.kv_tiers.kernels.page_gather import PageTable, word_dtype

assert word_dtype(6, [0, 2]) == (2, torch.int16) and word_dtype(16, [8, 24]) == (8, torch.int64)
assert word_dtype(16, [8, 3])[1] == torch.uint8
g = torch.Generator().manual_seed(5)
# odd page slices (3 bf16 = 6 bytes: int16 words) and a word-aligned case (int64 words), several blocks
for ps, heads, dim, dtype in ((3, 1, 1, torch.bfloat16), (4, 2, 8, torch.float32), (2, 3, 700, torch.float16)):
    layers = 5
    dev = [torch.randn(30 * ps + ps, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    host = torch.randn(40, layers, ps, heads, dim, generator=g).to(dtype)
    before_dev = [x.clone() for x in dev]
    cp = LayerListCopier("cpu", layers, ps * heads * dim, dtype, chunk_pages=3, kernel="triton")
    dp = torch.tensor([29, 0, 7, 8, 13, 30, 2])
    hp = torch.tensor([5, 6, 7, 39, 0, 1, 20])
    before = host.clone()
    cp.to_host(dev, host, dp, hp, ps)
    for d, h in zip(dp.tolist(), hp.tolist()):
        for k in range(layers):
            assert torch.equal(host[h, k], dev[k][d * ps:(d + 1) * ps]), (ps, d, h, k)
    rest = [p for p in range(40) if p not in hp.tolist()]
    assert torch.equal(host[rest], before[rest])
    host[hp] = torch.randn(len(hp), layers, ps, heads, dim, generator=g).to(dtype)
    target = torch.tensor([1, 3, 4, 10, 11, 12, 25])
    cp.to_device(host, hp, dev, target, ps)
    for d, h in zip(target.tolist(), hp.tolist()):
        for k in range(layers):
            assert torch.equal(dev[k][d * ps:(d + 1) * ps], host[h, k]), (ps, d, h, k)
    others = [r for r in range(dev[0].shape[0]) if r // ps not in target.tolist()]
    assert all(torch.equal(x[others], y[others]) for x, y in zip(dev, before_dev))
    assert isinstance(next(iter(cp._tables.values())), PageTable)
    assert len(cp._tables) == 1  # one table for the layer list, reused across calls and directions
print("ok")
"""


def test_triton_page_kernels_move_whole_pages_both_ways() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from triton_interpret import run_interpreted

    assert run_interpreted(TRITON_SCRIPT).strip().endswith("ok")
