"""Layer: ring_cp core (plain torch, no SGLang import). Where each token of a batch lives across CP ranks.

A `ShardPlan` splits every sequence of a variable-length batch into blocks and assigns them
to ranks, either zigzag (2N blocks per sequence; rank r owns blocks r and 2N-1-r, so causal
work is balanced) or contiguous (N blocks; rank r owns block r, for comparison). Block sizes
follow SGLang 0.5.23's zigzag rule: `len // nblocks`, the first `len % nblocks` blocks one
longer. A rank's local layout is sequence-major: for each sequence, its blocks in increasing
position order. Every rank can build every other rank's plan, so receive sizes are known
without a handshake.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

ShardMode = Literal["zigzag", "contiguous"]


@dataclass(frozen=True)
class Segment:
    """A run of consecutive positions of one sequence held by one rank."""

    seq: int
    start: int
    """First position inside the sequence."""
    length: int
    local: int
    """Offset of the first token in the owning rank's local layout."""

    @property
    def end(self) -> int:
        return self.start + self.length


def block_sizes(length: int, nblocks: int) -> list[int]:
    base, rem = divmod(int(length), nblocks)
    return [base + 1 if b < rem else base for b in range(nblocks)]


@dataclass(frozen=True)
class ShardPlan:
    world: int
    seq_lens: tuple[int, ...]
    mode: ShardMode
    segments: tuple[tuple[Segment, ...], ...]
    """segments[rank]: that rank's segments in local order."""

    @staticmethod
    def build(seq_lens: Sequence[int], world: int, mode: ShardMode = "zigzag") -> ShardPlan:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if mode not in ("zigzag", "contiguous"):
            raise ValueError(f"mode must be 'zigzag' or 'contiguous', got {mode!r}")
        if len(seq_lens) == 0:
            raise ValueError("seq_lens must name at least one sequence, got []")
        if any(int(n) < 1 for n in seq_lens):
            raise ValueError(f"seq_lens must all be >= 1, got {list(seq_lens)}")
        nblocks = 2 * world if mode == "zigzag" else world
        per_rank: list[list[Segment]] = [[] for _ in range(world)]
        offsets = [0] * world
        for seq, n in enumerate(seq_lens):
            sizes = block_sizes(int(n), nblocks)
            starts = [sum(sizes[:b]) for b in range(nblocks)]
            for rank in range(world):
                owned = [rank, nblocks - 1 - rank] if mode == "zigzag" else [rank]
                for b in owned:
                    if sizes[b] == 0:
                        continue
                    per_rank[rank].append(Segment(seq, starts[b], sizes[b], offsets[rank]))
                    offsets[rank] += sizes[b]
        return ShardPlan(world, tuple(int(n) for n in seq_lens), mode, tuple(tuple(s) for s in per_rank))

    def local_len(self, rank: int) -> int:
        return sum(s.length for s in self.segments[rank])

    @property
    def total(self) -> int:
        return sum(self.seq_lens)

    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    def global_index(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Token index into the packed full batch for each local token of `rank`."""
        cu = self.cu_seqlens()
        parts = [torch.arange(cu[s.seq] + s.start, cu[s.seq] + s.end, dtype=torch.long) for s in self.segments[rank]]
        idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        return idx.to(device)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rows of a packed full-batch tensor (tokens first) that `rank` holds, in local order."""
        return full.index_select(0, self.global_index(rank, full.device))

    def unshard(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard` over all ranks: packed full-batch order."""
        first = locals_[0]
        out = first.new_empty((self.total, *first.shape[1:]))
        for rank, x in enumerate(locals_):
            out.index_copy_(0, self.global_index(rank, x.device), x)
        return out

    def chunk_pieces(self, rank: int, nchunks: int) -> list[list[tuple[int, int]]]:
        """Cut `rank`'s shard into `nchunks` chunks, each taking the c-th near-equal slice of every segment.

        Returns, per chunk, the local [lo, hi) pieces that make it up, in order. Slicing every
        segment (instead of cutting the local layout into consecutive ranges) keeps each chunk's
        causal workload proportional to the shard's, so ring steps stay balanced across ranks.
        """
        out: list[list[tuple[int, int]]] = [[] for _ in range(nchunks)]
        for s in self.segments[rank]:
            lo = s.local
            for c, n in enumerate(block_sizes(s.length, nchunks)):
                if n:
                    out[c].append((lo, lo + n))
                lo += n
        return out

    def chunk_len(self, rank: int, nchunks: int, c: int) -> int:
        return sum(hi - lo for lo, hi in self.chunk_pieces(rank, nchunks)[c])

    def chunk_segments(self, rank: int, nchunks: int, c: int) -> list[Segment]:
        """Segments of chunk c of `rank`, with local offsets inside the chunk's packed buffer."""
        out, off = [], 0
        for lo, hi in self.chunk_pieces(rank, nchunks)[c]:
            for s in self.segments[rank]:
                if s.local <= lo < s.local + s.length:
                    out.append(Segment(s.seq, s.start + (lo - s.local), hi - lo, off))
                    break
            off += hi - lo
        return out

    def causal_work(self, rank: int) -> int:
        """Query-key pairs `rank` computes under causal masking (the load-balance measure)."""
        return sum((s.start + 1 + s.end) * s.length // 2 for s in self.segments[rank])
