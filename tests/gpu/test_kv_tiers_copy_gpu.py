"""kv_tiers' staged, double-buffered L1<->L2 page copier on CUDA: exact data through the
streams and events (both layouts, pinned and pageable host memory, uneven last chunk)."""
from __future__ import annotations

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.core.staged_copy import StagedCopier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("pinned", [True, False])
def test_staged_copy_is_exact_on_cuda(layout: str, pinned: bool) -> None:
    dev = torch.device("cuda")
    pages, layers, elems, n = 3000, 8, 256, 2500
    pool = (torch.randn(pages, layers * elems, device=dev) if layout == "page_first"
            else torch.randn(layers, pages, elems, device=dev)).to(torch.bfloat16)
    idx = torch.randperm(pages, device=dev)[:n]
    cp = StagedCopier(dev, layers * elems, torch.bfloat16, chunk_pages=333)
    host = torch.empty(n, layers * elems, dtype=torch.bfloat16, pin_memory=pinned)

    def pages_of() -> torch.Tensor:
        return pool[idx] if layout == "page_first" else pool[:, idx].transpose(0, 1).reshape(n, -1)

    for _ in range(3):  # reuse of the staging buffers across calls
        cp.to_host(pool, layout, idx, host)
        assert torch.equal(host, pages_of().cpu())
        new = torch.randn(n, layers * elems).to(torch.bfloat16)
        host.copy_(new)
        cp.to_device(host, pool, layout, idx)
        assert torch.equal(pages_of().cpu(), new)
