"""Byte blocks of a host pool's page, in place (core/host_pages.py): their concatenation is the
page's flat bytes for SGLang's MHA layouts, writing them changes that page only, and a view of
another buffer is refused."""
from __future__ import annotations

import pytest
import torch

from kllm_plugins.plugins.kv_tiers.core.host_pages import PageBlocks, block_offsets

LAYERS, PS, HEADS, DIM, PAGES = 3, 4, 2, 8, 5
SHAPES = {
    "layer_first": (2, LAYERS, PAGES * PS, HEADS, DIM),
    "page_first": (2, PAGES * PS, LAYERS, HEADS, DIM),
    "page_first_direct": (2, PAGES, LAYERS, PS, HEADS, DIM),
}


def _view(layout: str, buf: torch.Tensor, index: int) -> torch.Tensor:
    if layout == "layer_first":
        return buf[:, :, index : index + PS]
    if layout == "page_first":
        return buf[:, index : index + PS]
    return buf[:, index // PS : index // PS + 1]


@pytest.mark.parametrize("layout,blocks", [("layer_first", 2 * LAYERS), ("page_first", 2), ("page_first_direct", 2)])
def test_blocks_are_the_flat_page_and_writes_land_in_that_page_only(layout, blocks) -> None:
    buf = torch.randn(SHAPES[layout]).to(torch.bfloat16)
    pages = PageBlocks(buf, lambda i: _view(layout, buf, i))
    for p in range(PAGES):
        got = pages.blocks(p * PS)
        assert len(got) == blocks
        flat = _view(layout, buf, p * PS).flatten().view(torch.uint8).numpy().tobytes()
        assert b"".join(got) == flat
    before = buf.clone()
    new = torch.randn(_view(layout, buf, 0).shape).to(torch.bfloat16).flatten().view(torch.uint8).numpy().tobytes()
    at = 0
    for blk in pages.blocks(2 * PS):
        blk[:] = new[at : at + blk.nbytes]
        at += blk.nbytes
    assert _view(layout, buf, 2 * PS).flatten().view(torch.uint8).numpy().tobytes() == new
    for p in (0, 1, 3, 4):
        assert torch.equal(_view(layout, buf, p * PS), _view(layout, before, p * PS))


def test_block_offsets_of_contiguous_and_strided_views() -> None:
    assert block_offsets((4, 8), (8, 1), 2) == ([0], 64)
    assert block_offsets((2, 3), (10, 1), 4) == ([0, 40], 12)
    assert block_offsets((2, 1, 3), (6, 99, 1), 1) == ([0, 6], 3)  # size-1 dims do not split
    assert block_offsets((0, 3), (3, 1), 1) == ([], 0)


def test_a_view_of_another_buffer_or_a_non_contiguous_buffer_is_refused() -> None:
    buf, other = torch.zeros(2, 8, 4), torch.zeros(2, 8, 4)
    pages = PageBlocks(buf, lambda i: other[:, i : i + 2])
    with pytest.raises(ValueError):
        pages.blocks(0)
    with pytest.raises(ValueError):
        PageBlocks(buf.transpose(0, 1), lambda i: buf[:, i : i + 2])


@pytest.mark.parametrize("layout", list(SHAPES))
def test_arithmetic_page_mapping_matches_the_pool_views(layout) -> None:
    buf = torch.randn(SHAPES[layout]).to(torch.bfloat16)
    calls = []

    def view(i: int) -> torch.Tensor:
        calls.append(i)
        return _view(layout, buf, i)

    pages = PageBlocks(buf, view, page_size=PS, tokens=PAGES * PS)
    slow = PageBlocks(buf, lambda i: _view(layout, buf, i))
    assert pages._linear is not None
    n = len(calls)
    for p in range(PAGES):
        assert [bytes(b) for b in pages.blocks(p * PS)] == [bytes(b) for b in slow.blocks(p * PS)]
    assert len(calls) == n  # no torch view built per page once the mapping is known
    with pytest.raises(ValueError):
        PageBlocks(buf, lambda i: torch.zeros(3)[i % 2 : i % 2 + 1], page_size=PS, tokens=PAGES * PS)


@pytest.mark.parametrize("block", [16, 64 << 10])
def test_owned_copy_is_one_buffer_of_the_blocks_not_a_view_of_the_pool(block: int) -> None:
    """A page held while dormant is copied out of the host pool (whose page is reused after the
    call) into one buffer of its own, blocks in order, empty and read-only blocks included; small
    pages are joined, pages of GIL_RELEASE_BYTES or more copied by torch."""
    from kllm_plugins.plugins.kv_tiers.core.host_pages import owned_copy
    from kllm_plugins.plugins.kv_tiers.core.page_format import GIL_RELEASE_BYTES

    pool = torch.randint(0, 255, (16 * block,), dtype=torch.uint8)
    blocks = [memoryview(pool[:block].numpy()).cast("B"), memoryview(b""), memoryview(b"xyz"),
              memoryview(pool[2 * block:16 * block].numpy()).cast("B")]
    want = bytes(pool[:block].numpy()) + b"xyz" + bytes(pool[2 * block:].numpy())
    got = owned_copy(blocks)
    assert isinstance(got, bytes) == (len(want) < GIL_RELEASE_BYTES)
    assert bytes(got) == want
    pool.zero_()  # the pool's pages are reused: the held copy is not a view of them
    assert bytes(got) == want
