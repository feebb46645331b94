"""Layer: plugin core (torch only, no SGLang import). Byte views of one page of a host KV pool, in
the page's flat order, without copying it.

A page of a layer-first host pool lies in 2 x layers strided blocks, of a page-first pool in two (K
and V). Reading a page from L3 straight into these views (one `readv`) or writing it from them (one
`writev`) skips the staging copy HiCache's generic storage path makes per page: a zeroed flat page
read into and then copied into the pool, and a flattening copy before a write. The views follow the
C order of the pool's page view, which is the order `flatten()` gives, so a page's bytes are the same
whichever path wrote them.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from kllm_plugins.plugins.kv_tiers.core.page_format import GIL_RELEASE_BYTES


def block_offsets(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> tuple[list[int], int]:
    """(byte offsets of the contiguous blocks, in C order; bytes per block) of a strided view."""
    dims = [(n, s) for n, s in zip(shape, stride) if n != 1]
    if any(n == 0 for n in shape):
        return [], 0
    run = 1  # elements in the contiguous suffix
    j = len(dims) - 1
    while j >= 0 and dims[j][1] == run:
        run *= dims[j][0]
        j -= 1
    outer = dims[: j + 1]
    offsets = [sum(i * s for i, (_, s) in zip(idx, outer)) * itemsize
               for idx in itertools.product(*(range(n) for n, _ in outer))]
    return offsets, run * itemsize


class PageBlocks:
    """The blocks of page `index` of `buffer` (a contiguous CPU tensor, the pool's storage) as
    writable byte views, `page_view(index)` being the pool's (strided) view of that page.

    With `page_size` and `tokens` (the pool's token slots) given, and where the pool's page views
    start at offsets linear in the index (every SGLang MHA layout: checked on the first, second,
    middle and last page at construction), a page-aligned index is mapped by arithmetic instead of
    building a torch view (10 us per page on a slow CPU)."""

    def __init__(self, buffer: torch.Tensor, page_view: Callable[[int], torch.Tensor],
                 page_size: int = 0, tokens: int = 0) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("the host pool's buffer is not a contiguous CPU tensor")
        self._storage_ptr = buffer.untyped_storage().data_ptr()
        self._base = buffer.data_ptr()
        self._bytes = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
        self._page_view = page_view
        self._layouts: dict[tuple[tuple[int, ...], tuple[int, ...], int], tuple[list[int], int]] = {}
        self._linear: tuple[int, int, list[int], int] | None = None  # (start of page 0, bytes per index, offsets, length)
        self._page_size, self._tokens = page_size, tokens
        if page_size > 0 and tokens >= 2 * page_size:
            self._linear = self._fit_linear(page_size, tokens)

    def _place(self, index: int) -> tuple[int, tuple[list[int], int], tuple[tuple[int, ...], tuple[int, ...], int]]:
        view = self._page_view(index)
        if view.untyped_storage().data_ptr() != self._storage_ptr:
            raise ValueError("the pool's page view is not a view of its buffer")
        key = (tuple(view.shape), tuple(view.stride()), view.element_size())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = block_offsets(*key)
        return view.data_ptr() - self._base, layout, key

    def _fit_linear(self, ps: int, tokens: int) -> tuple[int, int, list[int], int] | None:
        last = (tokens // ps - 1) * ps
        s0, lay0, key0 = self._place(0)
        s1, _, key1 = self._place(ps)
        if (s1 - s0) % ps or key1 != key0:
            return None
        step = (s1 - s0) // ps
        for i in ({last // 2 // ps * ps, last} - {0, ps}):
            si, _, keyi = self._place(i)
            if keyi != key0 or si != s0 + i * step:
                return None
        return s0, step, lay0[0], lay0[1]

    def blocks(self, index: int) -> list[memoryview]:
        lin = self._linear
        if lin is not None and index % self._page_size == 0 and 0 <= index < self._tokens:
            start, offsets, length = lin[0] + index * lin[1], lin[2], lin[3]
        else:
            start, (offsets, length), _ = self._place(index)
        if start < 0 or (offsets and start + offsets[-1] + length > len(self._bytes)):
            raise ValueError(f"page {index} lies outside the pool's buffer")
        mv = self._bytes
        return [mv[start + o : start + o + length] for o in offsets]

    def nbytes(self, index: int) -> int:
        return sum(b.nbytes for b in self.blocks(index))


def owned_copy(parts: list[memoryview]) -> bytes | memoryview:
    """A fresh copy of a page's blocks, one buffer. A page of `GIL_RELEASE_BYTES` or more is copied
    by one torch op with the GIL released (`b"".join` holds it for the whole copy, about 0.2 ms for
    an 8B model's 2 MiB page, during which the scheduler's thread cannot run; one op per block
    would instead wait to take the GIL back once per block). A smaller page (the tiny model's
    32 KiB) is joined with the GIL held: taking it back after each would cost more than the copy."""
    total = sum(p.nbytes for p in parts)
    if total < GIL_RELEASE_BYTES:
        return b"".join(parts)
    srcs = [torch.frombuffer(bytearray(p) if p.readonly else p, dtype=torch.uint8) for p in parts if p.nbytes]
    return memoryview(torch.cat(srcs).numpy()).cast("B")
