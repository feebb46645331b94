"""kv_tiers' one-launch page gather / scatter (kernels/page_gather.py) through LayerListCopier on CUDA,
against the torch per-layer path and plain indexing: dtypes whose page slices take 8-, 2- and 1-byte
words, several blocks per slice, chunks that do not divide the pages, host runs and singles."""
from __future__ import annotations

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.core.staged_copy import LayerListCopier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rows(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)


@pytest.mark.parametrize("ps,heads,dim,dtype", [(16, 8, 128, torch.bfloat16), (3, 1, 1, torch.float16),
                                                (5, 3, 7, torch.uint8), (4, 2, 300, torch.float32)])
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_kernels_move_whole_pages_like_indexing(ps: int, heads: int, dim: int, dtype: torch.dtype, kernel: str) -> None:
    layers, dev_pages, host_pages, n = 6, 700, 900, 500
    g = torch.Generator().manual_seed(ps * dim)
    dev = [torch.randint(0, 100, (dev_pages * ps + ps, heads, dim), generator=g).to(dtype).cuda()
           for _ in range(layers)]
    host = torch.zeros(host_pages, layers, ps, heads, dim, dtype=dtype, pin_memory=True)
    dp = torch.randperm(dev_pages, generator=g)[:n].cuda()
    hp = torch.cat([torch.arange(100, 400), torch.arange(500, 700)])[:n]
    cp = LayerListCopier("cuda", layers, ps * heads * dim, dtype, chunk_pages=77, kernel=kernel)  # type: ignore[arg-type]
    assert cp.kernel == kernel
    cp.to_host(dev, host, dp, hp, ps)
    want = torch.stack([x[_rows(dp, ps)].view(n, ps, heads, dim) for x in dev], dim=1).cpu()
    assert torch.equal(host[hp], want)
    assert int(host[:100].count_nonzero()) == 0  # nothing outside the host pages written
    host[hp] = torch.randint(0, 100, (n, layers, ps, heads, dim), generator=g).to(dtype)
    target = torch.randperm(dev_pages, generator=g)[:n].cuda()
    before = [x.clone() for x in dev]
    cp.to_device(host, hp, dev, target, ps)
    got = torch.stack([x[_rows(target, ps)].view(n, ps, heads, dim) for x in dev], dim=1).cpu()
    assert torch.equal(got, host[hp])
    keep = torch.ones(dev[0].shape[0], dtype=torch.bool, device="cuda")
    keep[_rows(target, ps)] = False
    assert all(torch.equal(x[keep], y[keep]) for x, y in zip(dev, before))
