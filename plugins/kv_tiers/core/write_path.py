"""Layer: plugin core (no SGLang import). The one L3 write path of both storage backends.

HiCache offers a run of pages to the L3 backend; what happens next is the same for the file
store and for Mooncake, and lives here so that the two cannot drift apart:

1. shared sightings: while a page needs more than one sighting (under pressure, policy not
   dormant), pages this instance never saw are looked up among the offers of the instances
   sharing the store (the file store's `.seen/` markers, Mooncake's one-byte objects);
2. selective persistence admits a leading run (`PersistencePolicy.admit`);
3. the pages after the run are skipped (counted); while the policy is dormant a copy of each is
   kept in `HeldPages` (`dormant_hold_mb`);
4. the admitted run is written by the backend; the offer markers of written pages go;
5. once the policy is no longer dormant (reuse was seen), the held pages are written.

A backend supplies an `L3Writer` (the store's side: fill, markers, writing a held copy) and, per
call, a `PageBatch` (the offered pages in the host pool: write the first n, copy one).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from kllm_plugins.plugins.kv_tiers.core.held_pages import HeldPages
from kllm_plugins.plugins.kv_tiers.core.page_format import nbytes_of
from kllm_plugins.plugins.kv_tiers.core.tier_state import TierState

logger = logging.getLogger("kllm.kv_tiers")


class L3Writer(Protocol):
    """The store's side of a write."""

    def fill(self) -> float:
        """The store's fill fraction (capacity pressure at `fill_high` and above)."""
        ...

    def note_offered(self, keys: list[str]) -> list[bool] | None:
        """For each key, whether another instance sharing the store offered the page before
        (leaving this instance's offer for them); None when the store shares no sightings."""
        ...

    def forget_offered(self, keys: list[str]) -> None:
        """Remove the offer markers of pages just written."""
        ...

    def put_held(self, key: str, data: bytes | memoryview) -> bool:
        """Write a page kept in memory (`PageBatch.copy`'s bytes); whether it was written."""
        ...


class PageBatch(Protocol):
    """The pages of one write call, in the host pool."""

    def write(self, n: int) -> int:
        """Write the first `n` pages; how many leading pages were written."""
        ...

    def copy(self, i: int) -> bytes | memoryview | None:
        """A copy of page `i`'s bytes that the caller owns (the pool's page is reused after the
        call); None where the backend cannot write such a copy later (the page is then dropped, as
        with no hold)."""
        ...


@dataclass(frozen=True)
class WriteOutcome:
    offered: int
    admitted: int
    written: int

    @property
    def skipped(self) -> int:
        """Pages not written by choice (not a failure)."""
        return self.offered - self.admitted

    @property
    def complete(self) -> bool:
        """Every admitted page was written."""
        return self.written == self.admitted


def write_pages(state: TierState, writer: L3Writer, keys: list[str], batch: PageBatch) -> WriteOutcome:
    """Offer `keys` (the pages of `batch`) to L3 through the state's policies; see the module
    docstring. Exceptions of `batch.write` reach the caller (its pages count as skipped or not
    written; pages held before it stay held)."""
    p = state.persistence
    fill = writer.fill()
    busy = state.write_busy.fraction()
    # offer markers only matter when a page needs more than one sighting, and are left out
    # while the policy sees no reuse at all (dormant: a page then needs its sightings here)
    selective = p.threshold(fill, busy) > 1 and not p.dormant()
    if selective:
        fresh = [k for k in keys if not p.counter.count(k)]
        if fresh:
            seen = writer.note_offered(fresh)
            if seen is not None:
                p.note_remote_sightings(fresh, seen)
    adm = p.admit(keys, fill, busy)
    logger.debug("kv_tiers write: %d of %d pages admitted (bar %d, fill %.2f)", adm.admitted, len(keys),
                 adm.threshold, fill)
    dormant = p.dormant()
    skipped = len(keys) - adm.admitted
    if skipped:
        # Not an error: HiCache would log a failed write. The page simply stays out of L3.
        state.count("pages_skipped", skipped)
        state.meter.pages("skipped", skipped)
        if dormant and state.held.max_bytes:
            hold_tail(state.held, keys, batch, adm.admitted)
    written = batch.write(adm.admitted) if adm.admitted else 0
    if written:
        state.count("pages_admitted", written)
        state.meter.pages("written", written)
        if selective:
            writer.forget_offered(keys[:written])
    if not dormant and len(state.held):
        write_held(state, writer)
    return WriteOutcome(len(keys), adm.admitted, written)


def hold_tail(held: HeldPages, keys: list[str], batch: PageBatch, start: int) -> int:
    """Hold copies of the skipped pages `keys[start:]`, only as many of the last ones as the bounded
    buffer keeps: a page copied and then pushed out within the same call (a long prompt offers
    hundreds of pages, the buffer keeps tens) is a copy for nothing, on a thread that shares the
    GIL with the scheduler's. The buffer ends as if each page had been held in turn. How many
    were held."""
    tail: list[tuple[str, bytes | memoryview]] = []
    total = last = 0
    for i in range(len(keys) - 1, start - 1, -1):
        if last and total + last > held.max_bytes:  # the pages of one call are of one size
            break
        data = batch.copy(i)
        if data is None:
            continue
        n = last = nbytes_of(data)
        if total + n > held.max_bytes:
            break
        tail.append((keys[i], data))
        total += n
    for key, data in reversed(tail):
        held.hold(key, data, owned=True)
    return len(tail)


def write_held(state: TierState, writer: L3Writer) -> int:
    """Reuse is seen now: write the pages held back while the policy was dormant (oldest first);
    how many were written."""
    held = state.held.take_all()
    written = sum(1 for key, data in held if writer.put_held(key, data))
    state.count("held_written", written)
    state.meter.pages("written", written)
    logger.info("kv_tiers: reuse seen; wrote %d of %d pages held back while dormant", written, len(held))
    return written
