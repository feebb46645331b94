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
