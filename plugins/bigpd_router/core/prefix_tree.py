"""Layer: core (no SGLang import). Approximate prefix tree of routed requests.

Where instances do not publish KV events, the router remembers which instance it sent each
prompt to, at block granularity, and prefers the instance that holds the longest prefix of a
new prompt. It is approximate on purpose: instances evict on their own, so the tree is bounded
(LRU over blocks) and only used as a hint that is weighed against load.

Blocks are chained: the key of block i hashes block i together with the key of block i-1, so
a flat dict holds the whole tree and a lookup walks at most len(prompt)/block entries.
"""
from __future__ import annotations

import collections
import threading
from typing import Sequence, Union

Prompt = Union[str, Sequence[int]]


class PrefixTree:
    def __init__(self, block: int = 64, max_blocks: int = 200_000) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.block = block
        self.max_blocks = max_blocks
        # key -> set of instance urls that were sent this prefix; order = LRU (oldest first)
        self._nodes: collections.OrderedDict[int, set[str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _keys(self, prompt: Prompt) -> list[int]:
        keys: list[int] = []
        parent = 0
        step = self.block if isinstance(prompt, str) else max(1, self.block // 4)
        # only whole blocks: a partial tail is not a reusable prefix for a KV cache with pages
        for start in range(0, len(prompt) - step + 1, step):
            chunk = prompt[start:start + step]
            parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
            keys.append(parent)
        return keys

    def blocks_of(self, prompt: Prompt) -> int:
        return len(self._keys(prompt))

    def match(self, prompt: Prompt) -> dict[str, int]:
        """url -> number of leading blocks of `prompt` the router has sent to that instance."""
        keys = self._keys(prompt)
        out: dict[str, int] = {}
        with self._lock:
            alive: set[str] | None = None
            for depth, key in enumerate(keys):
                urls = self._nodes.get(key)
                if not urls:
                    break
                alive = set(urls) if alive is None else alive & urls
                if not alive:
                    break
                for url in alive:
                    out[url] = depth + 1
        return out

    def insert(self, prompt: Prompt, url: str) -> None:
        keys = self._keys(prompt)
        with self._lock:
            # touch deepest first so the shallow blocks end up most recent: eviction takes leaves first
            for key in reversed(keys):
                node = self._nodes.get(key)
                if node is None:
                    node = set()
                    self._nodes[key] = node
                node.add(url)
                self._nodes.move_to_end(key)
            while len(self._nodes) > self.max_blocks:
                self._nodes.popitem(last=False)

    def forget(self, url: str) -> None:
        """Drop an instance everywhere (it left the pool)."""
        with self._lock:
            empty = []
            for key, urls in self._nodes.items():
                urls.discard(url)
                if not urls:
                    empty.append(key)
            for key in empty:
                del self._nodes[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)
