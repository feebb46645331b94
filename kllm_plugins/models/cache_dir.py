"""Layer: host tooling (no SGLang import). Where built models are cached.

`KLLM_CACHE_DIR` overrides the default `~/.cache/kllm-plugins`. A build writes into a temporary
sibling folder and renames it into place, so a half-built model is never used.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def cache_root() -> Path:
    root = Path(os.environ.get("KLLM_CACHE_DIR") or Path.home() / ".cache" / "kllm-plugins")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Return the cached folder `name`, calling `build(tmp_folder)` first if it is missing."""
    final = cache_root() / name
    if (final / "config.json").exists():
        return final
    with _lock(final):
        if (final / "config.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root()))
        try:
            build(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
