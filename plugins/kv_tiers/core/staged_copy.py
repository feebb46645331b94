"""Layer: plugin core (plain torch, no SGLang import). Scattered KV pages between L1 and L2 at
contiguous-copy bandwidth.

Copying N scattered device pages to host one `copy_` at a time pays the launch and PCIe
transaction cost N times (8192 pages of 32 KiB: ~3 GB/s on an H200 against ~55 GB/s for one
pinned contiguous copy). Here pages move in chunks through device staging buffers:

    to host:   gather the chunk's pages on the device (HBM speed) into staging buffer b,
               then one pinned copy of b to the host, on a copy stream;
    to device: one pinned copy of the host chunk into b on the copy stream, then scatter b
               into the pool's pages on the device.

With two staging buffers the gather (or scatter) of one chunk overlaps the PCIe copy of the
other, so the link stays busy and the cost is the contiguous copy plus one chunk of gather.

Pool layouts (the device KV pool as one tensor; a "page" is what one host row holds):
    page-first:  [pages, page_elems]        a page is contiguous on the device;
    layer-first: [layers, pages, elems]     a page is `layers` slices, one per layer.
The host side is always page-major, `[n, page_elems]` (pinned for full speed), as SGLang's
page_first host layout. On a CPU "device" the same calls run synchronously (tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

import torch

Layout = Literal["page_first", "layer_first"]


def page_shape(pool: torch.Tensor, layout: Layout) -> tuple[int, int]:
    """(number of pages, elements per page) of a pool tensor in `layout`."""
    if layout == "page_first":
        if pool.dim() != 2:
            raise ValueError(f"page_first pool must be [pages, elems], got {tuple(pool.shape)}")
        return pool.shape[0], pool.shape[1]
    if layout == "layer_first":
        if pool.dim() != 3:
            raise ValueError(f"layer_first pool must be [layers, pages, elems], got {tuple(pool.shape)}")
        return pool.shape[1], pool.shape[0] * pool.shape[2]
    raise ValueError(f"unknown layout {layout!r}")


def _gather(pool: torch.Tensor, layout: Layout, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = page idx[i] of the pool, page-major."""
    if layout == "page_first":
        torch.index_select(pool, 0, idx, out=out)
    else:
        layers, _, elems = pool.shape
        out.view(len(idx), layers, elems).copy_(pool.index_select(1, idx).transpose(0, 1))


def _scatter(pool: torch.Tensor, layout: Layout, idx: torch.Tensor, src: torch.Tensor) -> None:
    """Page idx[i] of the pool = src[i] (page-major)."""
    if layout == "page_first":
        pool.index_copy_(0, idx, src)
    else:
        layers, _, elems = pool.shape
        pool.index_copy_(1, idx, src.view(len(idx), layers, elems).transpose(0, 1))


@dataclass
class StagedCopier:
    """Moves scattered pages between a device pool and a page-major host buffer through
    `num_buffers` device staging buffers of `chunk_pages` pages each."""

    device: torch.device
    page_elems: int
    dtype: torch.dtype
    chunk_pages: int = 1024
    num_buffers: int = 2
    gather_priority: int = 0
    """CUDA stream priority of the device-side gather of `LayerListCopier.to_host` (0: it runs on
    the caller's stream; negative: on a stream of its own at that priority, so that its blocks take
    the SMs ahead of the forward's kernels queued at the default priority)."""

    def __post_init__(self) -> None:
        if self.chunk_pages < 1 or self.num_buffers < 1:
            raise ValueError(f"chunk_pages and num_buffers must be >= 1, got {self.chunk_pages}, {self.num_buffers}")
        self.device = torch.device(self.device)
        self._cuda = self.device.type == "cuda"
        self._bufs = [torch.empty(self.chunk_pages, self.page_elems, dtype=self.dtype, device=self.device)
                      for _ in range(self.num_buffers if self._cuda else 0)]
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._free = [torch.cuda.Event() for _ in self._bufs]
            self._ready = [torch.cuda.Event() for _ in self._bufs]
        self._gather_stream = (torch.cuda.Stream(device=self.device, priority=self.gather_priority)
                               if self._cuda and self.gather_priority else None)

    def _check(self, pool: torch.Tensor, layout: Layout, pages: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        _, elems = page_shape(pool, layout)
        if elems != self.page_elems or pool.dtype != self.dtype or host.dtype != self.dtype:
            raise ValueError(f"pool pages have {elems} {pool.dtype} elements, copier expects "
                             f"{self.page_elems} {self.dtype} (host {host.dtype})")
        if host.dim() != 2 or host.shape[0] != pages.numel() or host.shape[1] != self.page_elems:
            raise ValueError(f"host buffer must be [{pages.numel()}, {self.page_elems}], got {tuple(host.shape)}")
        return pages.to(device=pool.device, dtype=torch.long)

    def to_host(self, pool: torch.Tensor, layout: Layout, pages: torch.Tensor, host: torch.Tensor) -> None:
        """host[i] = page pages[i] of the device pool. Returns once the data is on the host."""
        idx = self._check(pool, layout, pages, host)
        if not self._cuda:
            for s in range(0, idx.numel(), self.chunk_pages):
                _gather(pool, layout, idx[s:s + self.chunk_pages], host[s:s + self.chunk_pages])
            return
        main = torch.cuda.current_stream(self.device)
        for k, s in enumerate(range(0, idx.numel(), self.chunk_pages)):
            b = k % len(self._bufs)
            n = min(self.chunk_pages, idx.numel() - s)
            buf = self._bufs[b][:n]
            main.wait_event(self._free[b])  # the copy out of this buffer (two chunks ago) is done
            _gather(pool, layout, idx[s:s + n], buf)
            self._ready[b].record(main)
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._ready[b])
                host[s:s + n].copy_(buf, non_blocking=True)
                self._free[b].record(self._copy_stream)
        self._copy_stream.synchronize()

    def to_device(self, host: torch.Tensor, pool: torch.Tensor, layout: Layout, pages: torch.Tensor) -> None:
        """Page pages[i] of the device pool = host[i]. Returns once the pool holds the data."""
        idx = self._check(pool, layout, pages, host)
        if not self._cuda:
            for s in range(0, idx.numel(), self.chunk_pages):
                _scatter(pool, layout, idx[s:s + self.chunk_pages], host[s:s + self.chunk_pages])
            return
        main = torch.cuda.current_stream(self.device)
        for k, s in enumerate(range(0, idx.numel(), self.chunk_pages)):
            b = k % len(self._bufs)
            n = min(self.chunk_pages, idx.numel() - s)
            buf = self._bufs[b][:n]
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._free[b])  # the scatter out of this buffer is done
                buf.copy_(host[s:s + n], non_blocking=True)
                self._ready[b].record(self._copy_stream)
            main.wait_event(self._ready[b])
            _scatter(pool, layout, idx[s:s + n], buf)
            self._free[b].record(main)
        main.synchronize()


# -- SGLang's HiCache pool shapes: per-layer device tensors, page-major host pool --------------


def page_ids(token_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of page-aligned token indices (HiCache moves whole pages: `page_size` consecutive
    token slots starting at a multiple of `page_size`). Alignment is checked on CPU indices only:
    on a device the check would stall the caller until the device is idle."""
    idx = token_indices.reshape(-1)
    if idx.numel() % page_size:
        raise ValueError(f"{idx.numel()} token indices are not whole pages of {page_size}")
    first = idx[::page_size]
    if page_size > 1 and first.device.type == "cpu" and bool((first % page_size).ne(0).any()):
        raise ValueError("token indices are not page-aligned")
    return torch.div(first, page_size, rounding_mode="floor")


def runs(pages: torch.Tensor | Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset in `pages`, first page, length) of each maximal run of consecutive page ids: one
    DMA per run on the host side (HiCache's host allocator hands out mostly consecutive pages)."""
    p = pages.detach().to("cpu", torch.long).tolist() if isinstance(pages, torch.Tensor) else pages
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(p):
        if out and v == out[-1][1] + out[-1][2] and i == out[-1][0] + out[-1][2]:
            o, f, n = out[-1]
            out[-1] = (o, f, n + 1)
        else:
            out.append((i, v, 1))
    return out


def host_order(dev: torch.Tensor, hl: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The (device page, host page) pairs sorted by host page when that leaves fewer runs of
    consecutive host pages (one DMA each): HiCache's host free list hands a transfer its pages in
    freed order, so consecutive pages can sit apart in the list. Any order of the pairs moves the
    same data. The permutation reaches the device without a host sync (pinned, non-blocking, on the
    caller's stream)."""
    if len(hl) < 2 or all(a < b for a, b in zip(hl, hl[1:])):
        return dev, hl
    order = sorted(range(len(hl)), key=hl.__getitem__)
    merged = [hl[i] for i in order]
    if len(runs(merged)) >= len(runs(hl)):
        return dev, hl
    perm = torch.tensor(order, dtype=torch.long)
    if dev.is_cuda:
        perm = perm.pin_memory().to(dev.device, non_blocking=True)
    return dev[perm], merged


def _layer_pages(layer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A device layer [token rows, ...] as [pages, page_size * row elements] (a view)."""
    rows = layer.shape[0] - layer.shape[0] % page_size
    return layer[:rows].reshape(rows // page_size, -1)


Kernel = Literal["auto", "triton", "torch"]


class _Pages(Protocol):
    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None: ...

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None: ...


class _TorchPages:
    """The per-layer fallback: two kernels per layer and chunk (index_select, strided copy)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        staged = out.view(idx.numel(), len(self.views), -1)
        for i, v in enumerate(self.views):
            staged[:, i].copy_(v.index_select(0, idx))

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        staged = src.view(idx.numel(), len(self.views), -1)
        for i, v in enumerate(self.views):
            v.index_copy_(0, idx, staged[:, i])


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class LayerListCopier:
    """Whole pages between SGLang-shaped pools through a `StagedCopier`'s staging buffers.

    Device: one tensor per layer, `[token rows, heads, dim]` (SGLang's MHA `k_buffer` / `v_buffer`
    lists), a page = `page_size` consecutive rows of every layer. Host: `[host pages, layers,
    page_size, heads, dim]` (HiCache's `page_first_direct` host layout), a page contiguous over
    all layers. To host: per chunk, gather the chunk's pages of every layer into a staging buffer
    (device memory speed), then one copy per run of consecutive host pages on the copy stream. To
    device: one copy per host run into staging, then scatter into every layer.

    `kernel`: "triton" gathers / scatters a chunk of every layer in one launch
    (kernels/page_gather.py, through a device table of the layers' addresses); "torch" issues two
    kernels per layer and chunk, whose launch time (about 1 ms per chunk for 32 layers) is as long
    as the PCIe copy it should hide behind; "auto" takes triton on CUDA when it is installed.

    `sync=False` leaves the work ordered on the caller's current stream instead of waiting for it
    (what HiCache's controller expects: it records its own completion event on that stream)."""

    def __init__(self, device: torch.device | str, layers: int, page_elems_per_layer: int, dtype: torch.dtype,
                 chunk_pages: int = 256, num_buffers: int = 2, kernel: Kernel = "auto",
                 gather_priority: int = 0, merge_host_runs: bool = True) -> None:
        if kernel not in ("auto", "triton", "torch"):
            raise ValueError(f"kernel must be auto, triton or torch, got {kernel!r}")
        self.layers = layers
        self.per_layer = page_elems_per_layer
        self.staged = StagedCopier(torch.device(device), layers * page_elems_per_layer, dtype, chunk_pages,
                                   num_buffers, gather_priority)
        if kernel == "auto":
            kernel = "triton" if self.staged._cuda and _triton_ok() else "torch"
        self.kernel = kernel
        self.merge_host_runs = merge_host_runs
        """Reorder a transfer's pages by host page where that merges host runs (`host_order`)."""
        self.calls = {"to_host": 0, "to_device": 0}
        self.copies = {"to_host": 0, "to_device": 0}
        """Host-side copies issued (one per run of consecutive host pages in a chunk)."""
        self._tables: dict[tuple[int, ...], _Pages] = {}

    def _check(self, layers: Sequence[torch.Tensor], host: torch.Tensor, page_size: int) -> torch.Tensor:
        if len(layers) != self.layers:
            raise ValueError(f"{len(layers)} device layers, copier built for {self.layers}")
        flat = host.reshape(host.shape[0], -1)
        if flat.shape[1] != self.staged.page_elems or host.dtype != self.staged.dtype:
            raise ValueError(f"host pages have {flat.shape[1]} {host.dtype} elements, copier expects "
                             f"{self.staged.page_elems} {self.staged.dtype}")
        if _layer_pages(layers[0], page_size).shape[1] != self.per_layer:
            raise ValueError("device layer page size does not match the copier")
        return flat

    def _pages(self, layers: Sequence[torch.Tensor], page_size: int) -> _Pages:
        """Gather / scatter over these layers: the triton page table is built once per layer list
        (keyed by the layers' addresses and sizes; SGLang's pool tensors live as long as the pool)."""
        key = (page_size, *(x.data_ptr() for x in layers), *(x.shape[0] for x in layers))
        table = self._tables.get(key)
        if table is None:
            views = [_layer_pages(x, page_size) for x in layers]
            if self.kernel == "triton" and all(v.is_contiguous() for v in views):
                from ..kernels.page_gather import PageTable

                table = PageTable(views)
            else:  # the torch path reads strided layers as well
                table = _TorchPages(views)
            if len(self._tables) >= 8:  # a pool has two lists (K, V); others are transient
                self._tables.clear()
            self._tables[key] = table
        return table

    def plan(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """A transfer's pages as the copy loops take them: device page ids on the copier's device,
        host page ids as a list (one host sync), reordered by host page where that merges runs.
        A caller moving K and V over the same pages plans once and passes the plan to both."""
        dev = device_pages.to(device=self.staged.device, dtype=torch.long)
        hl = host_pages.detach().to("cpu", torch.long).tolist()
        return host_order(dev, hl) if self.merge_host_runs else (dev, hl)

    def _begin(self, direction: str, layers: Sequence[torch.Tensor], host: torch.Tensor,
               device_pages: torch.Tensor, host_pages: torch.Tensor | list[int], page_size: int
               ) -> tuple[torch.Tensor, Any, torch.Tensor, list[int]]:
        """What both directions start from: the host pool as [pages, elements], the layers' page
        access, and the pages planned (`plan`; a list of host pages means they already are)."""
        flat = self._check(layers, host, page_size)
        pages = self._pages(layers, page_size)
        self.calls[direction] += 1
        if isinstance(host_pages, list):
            return flat, pages, device_pages, host_pages
        return (flat, pages, *self.plan(device_pages, host_pages))

    def to_host(self, layers: Sequence[torch.Tensor], host: torch.Tensor, device_pages: torch.Tensor,
                host_pages: torch.Tensor | list[int], page_size: int, sync: bool = True) -> None:
        """host page host_pages[i] = device page device_pages[i] (all layers); the pages as given
        or as `plan` returned them."""
        flat, pages, dev, hl = self._begin("to_host", layers, host, device_pages, host_pages, page_size)
        st = self.staged
        if not st._cuda:
            for s in range(0, dev.numel(), st.chunk_pages):
                idx = dev[s:s + st.chunk_pages]
                out = torch.empty(idx.numel(), st.page_elems, dtype=flat.dtype, device=flat.device)
                pages.gather(idx, out)
                flat.index_copy_(0, torch.tensor(hl[s:s + st.chunk_pages], dtype=torch.long), out)
            return
        main = torch.cuda.current_stream(st.device)
        # the gather runs on the caller's stream or, with a priority, on the copier's own stream after
        # what the caller queued; either way the copies wait for it and the caller for the copies
        gs = st._gather_stream or main
        if gs is not main:
            gs.wait_stream(main)
        for k, s in enumerate(range(0, dev.numel(), st.chunk_pages)):
            b = k % len(st._bufs)
            n = min(st.chunk_pages, dev.numel() - s)
            buf = st._bufs[b][:n]
            gs.wait_event(st._free[b])
            with torch.cuda.stream(gs):
                pages.gather(dev[s:s + n], buf)
            st._ready[b].record(gs)
            with torch.cuda.stream(st._copy_stream):
                st._copy_stream.wait_event(st._ready[b])
                for off, first, length in (rr := runs(hl[s:s + n])):
                    flat[first:first + length].copy_(buf[off:off + length], non_blocking=True)
                self.copies["to_host"] += len(rr)
                st._free[b].record(st._copy_stream)
        if sync:
            st._copy_stream.synchronize()
        else:
            main.wait_stream(st._copy_stream)

    def to_device(self, host: torch.Tensor, host_pages: torch.Tensor | list[int], layers: Sequence[torch.Tensor],
                  device_pages: torch.Tensor, page_size: int, sync: bool = True) -> None:
        """device page device_pages[i] = host page host_pages[i] (all layers); the pages as given
        or as `plan` returned them."""
        flat, pages, dev, hl = self._begin("to_device", layers, host, device_pages, host_pages, page_size)
        st = self.staged
        if not st._cuda:
            for s in range(0, dev.numel(), st.chunk_pages):
                src = flat.index_select(0, torch.tensor(hl[s:s + st.chunk_pages], dtype=torch.long))
                pages.scatter(dev[s:s + st.chunk_pages], src.to(layers[0].device))
            return
        main = torch.cuda.current_stream(st.device)
        for k, s in enumerate(range(0, dev.numel(), st.chunk_pages)):
            b = k % len(st._bufs)
            n = min(st.chunk_pages, dev.numel() - s)
            buf = st._bufs[b][:n]
            with torch.cuda.stream(st._copy_stream):
                st._copy_stream.wait_event(st._free[b])
                for off, first, length in (rr := runs(hl[s:s + n])):
                    buf[off:off + length].copy_(flat[first:first + length], non_blocking=True)
                self.copies["to_device"] += len(rr)
                st._ready[b].record(st._copy_stream)
            main.wait_event(st._ready[b])
            pages.scatter(dev[s:s + n], buf)
            st._free[b].record(main)
        if sync:
            main.synchronize()
