"""Layer: kv_tiers device kernel (Triton; no SGLang import). Pages of many per-layer tensors to and
from one page-major staging buffer, in one launch.

SGLang's MHA pool keeps one device tensor per layer, so a page of KV is `layers` slices in
`layers` separate allocations. Gathering a chunk of pages with torch costs two kernels per layer
(index_select, then a strided copy into the staging buffer): 64 launches per chunk for 32 layers,
about a millisecond of launch time, as long as the PCIe copy of the chunk it should hide behind.
Here one program moves one (page, layer, block) through a device table of the layers' base
addresses, so a chunk is one launch whatever the number of layers.

Bytes are moved as the widest integer word that divides the page slice and every address, so the
kernel does not depend on the KV dtype. Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_BLOCK = 1024


# One program moves one (page, layer, block): pool page idx[page] of `layer` <-> staging[page, layer].
# The direction is a compile-time constant, so each direction compiles to its own straight copy.
@triton.jit
def _page_move_kernel(bases, idx, staging, words, layers, TO_STAGING: tl.constexpr, BLOCK: tl.constexpr):
    page = tl.program_id(0)
    layer = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < words
    pool = tl.load(bases + layer).to(tl.pointer_type(staging.dtype.element_ty))
    at_pool = tl.load(idx + page).to(tl.int64) * words + offs
    at_staging = (page.to(tl.int64) * layers + layer) * words + offs
    if TO_STAGING:
        tl.store(staging + at_staging, tl.load(pool + at_pool, mask=ok), mask=ok)
    else:
        tl.store(pool + at_pool, tl.load(staging + at_staging, mask=ok), mask=ok)


def word_dtype(nbytes: int, addresses: Sequence[int]) -> tuple[int, torch.dtype]:
    """(bytes, dtype) of the widest word dividing `nbytes` and every address."""
    for size, dt in _WORDS:
        if nbytes % size == 0 and all(a % size == 0 for a in addresses):
            return size, dt
    return 1, torch.uint8


class PageTable:
    """The base addresses of a fixed list of per-layer page views `[pages, page_elems]` (contiguous,
    same shape and dtype), as a device table for the kernels. Build it once per pool: the table
    is only valid while those tensors live, so the caller keeps them (SGLang's pool does)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        first = views[0]
        if any(not v.is_contiguous() or v.shape[1:] != first.shape[1:] or v.dtype != first.dtype
               or v.device != first.device for v in views):
            raise ValueError("layer page views must be contiguous, of one shape, dtype and device")
        self.views = list(views)
        self.layers = len(views)
        self.page_bytes = first.shape[1] * first.element_size()
        self.word_bytes, self.word = word_dtype(self.page_bytes, [v.data_ptr() for v in views])
        self.words = self.page_bytes // self.word_bytes
        self.bases = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=first.device)
        self.key = tuple(v.data_ptr() for v in views)

    def _staging(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        flat = buf.reshape(-1).view(torch.uint8)
        if flat.numel() < n * self.layers * self.page_bytes or flat.data_ptr() % self.word_bytes:
            raise ValueError("staging buffer too small or misaligned for the page table")
        return flat[: n * self.layers * self.page_bytes].view(self.word)

    def _move(self, idx: torch.Tensor, staging: torch.Tensor, to_staging: bool) -> None:
        n = idx.numel()
        if n == 0:
            return
        grid = (n, self.layers, triton.cdiv(self.words, _BLOCK))
        _page_move_kernel[grid](self.bases, idx, self._staging(staging, n), self.words, self.layers,
                                TO_STAGING=to_staging, BLOCK=_BLOCK)

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """out viewed as [n, layers, page] = page idx[i] of every layer (one launch)."""
        self._move(idx, out, True)

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        """Page idx[i] of every layer = src viewed as [n, layers, page] (one launch)."""
        self._move(idx, src, False)
