"""Layer: plugin config (no SGLang import). Options of the incr_prefix plugin."""
from __future__ import annotations

from dataclasses import dataclass

from kllm_plugins.spec import check_config, option


@dataclass(frozen=True)
class IncrPrefixConfig:
    enabled: bool = option(True, "serve chunk checkpoints with tail-only inserts")
    """Serve chunk checkpoints with tail-only inserts (false: the backend behaves exactly as stock)."""
    min_prefix_tokens: int = option(0, "use the tail-only insert only above this protected prefix", ge=0)
    """Use the tail-only insert only when the protected prefix has at least this many tokens."""
    verify: bool = option(False, "debug: re-match from the root after each tail insert")
    """Debug: after each tail-only insert, re-match the key from the root and assert the same node."""
    force_python_treecore: bool = option(
        False, 'build the kllm_incremental cache on the Python TreeCore (the only one with a tail-only walk)')
    """Build the kllm_incremental cache on SGLang's Python TreeCore even where the Rust one would
    be chosen: the Rust binding has no insert-from-node entry, so only the Python core gets a
    tail-only walk (on Rust only the work around the walk is tail-only). Pays off for very long
    chunked prompts; short prompts are faster on Rust."""
    waiting_match_memo: bool = option(
        True, "skip a waiting request's per-pass re-match when its previous result provably still holds")
    """Answer a waiting request's per-pass prefix re-match from its previous result when that
    provably still holds (cache-aware schedule policies; Python TreeCore)."""
    publish_interval_s: float = option(0.5, "seconds between counter snapshots for /kllm/stats", gt=0, le=60)
    """Seconds between counter snapshots written for /kllm/stats."""

    def __post_init__(self) -> None:
        check_config(self)
