"""Layer: plugin core (no SGLang import). Per-request walk state and the cheap staleness check.

After a chunk is checkpointed into the radix tree, the request holds a lock on the node its
insert ended on, and the path from the root to that node spells exactly the request's first
`cache_protected_len` tokens. The next chunk only has to insert the new tail under that node.
This module decides, from plain values the adapter reads off the tree and the request, whether
that shortcut is still valid or the stock walk from the root has to run, and counts both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Route(str, Enum):
    """How one checkpoint was served."""

    TAIL = "tail"
    """Fast path: insert only `[cache_protected_len, up_to)` under the saved node."""
    FULL = "full"
    """Stock path: SGLang's walk from the root."""


class Reason(str, Enum):
    """Why a checkpoint took the stock path (the fast path has no reason)."""

    DISABLED = "disabled"
    """The plugin's fast path is switched off by config."""
    UNSUPPORTED_CACHE = "unsupported_cache"
    """A cache feature the fast path does not reproduce (TreeCore, components, HiCache, sessions, EAGLE)."""
    NO_STATE = "no_state"
    """First checkpoint of the request: nothing saved yet; the stock walk records the state."""
    STALE = "stale"
    """The saved state no longer matches the request or the tree (re-admission, retraction, reset)."""
    SHORT = "short"
    """Nothing page-aligned to insert, or the protected prefix is below `min_prefix_tokens`."""
    PROMPT_SPLIT = "prompt_split"
    """The key runs past the prompt and the prompt boundary falls inside a node: the stock
    prompt-boundary split is needed."""
    ROTATION = "rotation"
    """KV-rotation bases are in use; the stock insert checks them from the root."""
    FINISH = "finish"
    """Rust TreeCore only: the finishing checkpoint (once per request) stays stock; it also
    splits at the prompt boundary."""


@dataclass(frozen=True)
class WalkState:
    """Where the request's previous checkpoint left the tree.

    node_id: the node the insert ended on (and the request locked).
    depth:   tokens on the root-to-node path, equal to the request's `cache_protected_len`.
    epoch:   the cache's reset epoch when the state was saved; a reset renumbers nodes.
    """

    node_id: object
    depth: int
    epoch: int


@dataclass(frozen=True)
class Observed:
    """What the adapter reads off the request and the tree just before a checkpoint.

    last_node:        the request's `last_node`.
    locked_node:      the node its tree lock holds (None without a lock).
    protected_len:    the request's `cache_protected_len`.
    epoch:            the cache's current reset epoch.
    node_alive:       the node is still attached and holds device KV (not evicted).
    """

    last_node: object
    locked_node: object
    protected_len: int
    epoch: int
    node_alive: bool


def check_state(saved: WalkState | None, seen: Observed) -> Reason | None:
    """Return None when the tail-only insert is safe, else why it is not.

    Every test is O(1): equality of ids and integers and one flag. Correctness rests on two
    SGLang invariants: a locked node is neither evicted nor re-parented, and a split by another
    request inserts the new node *above* the split one, so the locked node keeps its end depth.
    """
    if saved is None:
        return Reason.NO_STATE
    if (
        saved.epoch != seen.epoch
        or saved.node_id != seen.last_node
        or seen.locked_node != seen.last_node
        or saved.depth != seen.protected_len
        or not seen.node_alive
    ):
        return Reason.STALE
    return None


def prompt_touch_depth(prompt_len: int, key_len: int, start: int, node_ends: list[int] | None) -> int | None | Reason:
    """Plan the prompt-boundary insert that stock SGLang runs after a checkpoint whose key
    runs past the prompt (so eviction can drop output KV without the prompt).

    prompt_len, key_len: page-aligned lengths of the prompt and of the checkpoint key.
    start:     the protected prefix the tail insert starts from.
    node_ends: end depths of the nodes on the protected path (None if not collected).

    Returns None when stock runs no such insert; a depth when the boundary is already a node
    boundary on the protected path, so the stock insert would only touch the path down to that
    depth (no split, no free); Reason.PROMPT_SPLIT when a real split is needed.
    """
    if not 0 < prompt_len < key_len:
        return None
    if prompt_len == start:
        return prompt_len
    if prompt_len < start and node_ends is not None and prompt_len in node_ends:
        return prompt_len
    return Reason.PROMPT_SPLIT


@dataclass
class IncrCounters:
    """Checkpoint routing counters, exported as metrics and /kllm/stats."""

    tail_inserts: int = 0
    tail_tokens: int = 0
    """Tokens inserted by tail-only inserts (the walk the fast path did)."""
    skipped_tokens: int = 0
    """Protected-prefix tokens the fast path did not re-walk."""
    full_walks: int = 0
    full_by_reason: dict[str, int] = field(default_factory=dict)
    tail_seconds: float = 0.0
    """Wall time spent in tail-only checkpoints."""
    full_seconds: float = 0.0
    """Wall time spent in stock-path checkpoints (the first one of each request included)."""
    rematch_skipped: int = 0
    """Waiting-queue re-matches answered from the previous result (it provably still held)."""
    rematch_done: int = 0
    """Waiting-queue matches that walked the tree (first match, or the result could have changed)."""

    def record_tail(self, new_tokens: int, skipped: int) -> None:
        self.tail_inserts += 1
        self.tail_tokens += new_tokens
        self.skipped_tokens += skipped

    def record_full(self, reason: Reason) -> None:
        self.full_walks += 1
        key = reason._value_  # plain attribute: `.value` is a descriptor call on every checkpoint
        self.full_by_reason[key] = self.full_by_reason.get(key, 0) + 1

    @property
    def fallbacks(self) -> int:
        """Stock walks caused by stale state (what the issue calls fallbacks)."""
        return self.full_by_reason.get(Reason.STALE.value, 0)

    def snapshot(self) -> dict[str, object]:
        snap = asdict(self)
        snap["fallbacks"] = self.fallbacks
        return snap
