"""Layer: plugin config (no SGLang import). Options of the incr_prefix plugin."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IncrPrefixConfig:
    enabled: bool = True
    """Serve chunk checkpoints with tail-only inserts (false: the backend behaves exactly as stock)."""
    min_prefix_tokens: int = 0
    """Use the tail-only insert only when the protected prefix has at least this many tokens."""
    verify: bool = False
    """Debug: after each tail-only insert, re-match the key from the root and assert the same node."""
    force_python_treecore: bool = False
    """Build the kllm_incremental cache on SGLang's Python TreeCore even where the Rust one would
    be chosen: the Rust binding has no insert-from-node entry, so only the Python core gets a
    tail-only walk (on Rust only the work around the walk is tail-only). Pays off for very long
    chunked prompts; short prompts are faster on Rust."""
    waiting_match_memo: bool = True
    """Answer a waiting request's per-pass prefix re-match from its previous result when that
    provably still holds (cache-aware schedule policies; Python TreeCore)."""
    publish_interval_s: float = 0.5
    """Seconds between counter snapshots written for /kllm/stats."""

    def __post_init__(self) -> None:
        if self.min_prefix_tokens < 0:
            raise ValueError(f"min_prefix_tokens must be >= 0, got {self.min_prefix_tokens}")
        if not 0 < self.publish_interval_s <= 60:
            raise ValueError(f"publish_interval_s must be in (0, 60], got {self.publish_interval_s}")
