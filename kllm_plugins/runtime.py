"""Layer: host core (no SGLang import). Per-process record of what the host enabled.

Plugin adapters read their frozen config here (`config_of`), so hook bodies never parse options.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any

_configs: dict[str, Any] = {}


def set_config(name: str, config: Any) -> None:
    _configs[name] = config


def config_of(name: str) -> Any:
    """The enabled plugin's config in this process; KeyError if the plugin is not enabled here."""
    return _configs[name]


def is_enabled(name: str) -> bool:
    return name in _configs


def enabled_names() -> list[str]:
    return list(_configs)


def clear() -> None:
    _configs.clear()


def process_role() -> str:
    """"main" for the process the user started, "subprocess" for SGLang's spawned children."""
    return "main" if multiprocessing.parent_process() is None else "subprocess"


def strict() -> bool:
    return os.environ.get("KLLM_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def run_dir() -> str:
    """A folder shared by the server's processes (set by the main process before it spawns)."""
    path = os.environ.get("KLLM_RUN_DIR")
    if not path:
        import tempfile

        path = tempfile.mkdtemp(prefix=f"kllm-{os.getpid()}-")
        os.environ["KLLM_RUN_DIR"] = path
    os.makedirs(path, exist_ok=True)
    return path
