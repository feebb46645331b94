"""Shared by the host's attach tests: a hook registry double."""
from __future__ import annotations

from typing import Any, Callable

from kllm_plugins.attach import resolve_target


class WrappingRegistry:
    """Applies AROUND hooks for real (like SGLang's HookRegistry) unless told to drop some."""

    def __init__(self, drop: set[str] | None = None) -> None:
        self.hooks: list[tuple[str, Callable[..., Any], str]] = []
        self.drop = drop or set()
        self.applied = 0

    def register(self, target: str, fn: Callable[..., Any], kind: str) -> None:
        self.hooks.append((target, fn, kind))

    def apply(self) -> None:
        self.applied += 1
        for target, fn, _kind in self.hooks:
            if target in self.drop:
                continue
            owner_path, _, attr = target.rpartition(".")
            owner = resolve_target(owner_path)
            original = getattr(owner, attr)

            def wrapper(*a: Any, __o: Any = original, __f: Any = fn, **k: Any) -> Any:
                return __f(__o, *a, **k)

            setattr(owner, attr, wrapper)
        self.hooks.clear()
