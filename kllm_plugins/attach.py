"""Layer: host core (no SGLang import). Registers each enabled plugin's patches through a
hook registry and verifies, target by target, that they really attached.

SGLang logs and swallows a plugin whose hook fails to apply; this module is how the suite
notices. The registry is passed in (`HookRegistryLike`), so the logic is testable without SGLang.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kllm_plugins.spec import PatchSpec

logger = logging.getLogger("kllm.attach")


class HookRegistryLike(Protocol):
    def register(self, target: str, fn: Callable[..., Any], kind: str) -> None: ...
    def apply(self) -> None: ...


def resolve_impl(impl: str) -> Any:
    """Resolve "module:attr" (attr may be dotted)."""
    module, _, attr = impl.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def import_prefix(dotted: str) -> tuple[Any, list[str]]:
    """Import the longest importable module prefix of `dotted`; return it and the rest.

    Unlike pkgutil.resolve_name, an ImportError raised *inside* a module that exists is
    re-raised, so a missing dependency is reported as itself, not as a missing attribute.
    """
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            return importlib.import_module(name), parts[i:]
        except ModuleNotFoundError as exc:
            if exc.name is not None and name != exc.name and not name.startswith(exc.name + "."):
                raise
    raise ModuleNotFoundError(f"no importable module in {dotted!r}", name=parts[0])


def resolve_target(target: str) -> Any:
    """Resolve a dotted SGLang path the way SGLang's HookRegistry does, returning the raw
    attribute (a classmethod/staticmethod object is unwrapped to its function)."""
    obj, rest = import_prefix(target)
    if not rest:
        return obj
    for part in rest[:-1]:
        obj = getattr(obj, part)
    attr = rest[-1]
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                return getattr(raw, "__func__", raw)
    return getattr(obj, attr)


@dataclass
class AttachResult:
    plugin: str
    target: str
    kind: str
    ok: bool
    reason: str = ""


@dataclass
class AttachReport:
    results: list[AttachResult] = field(default_factory=list)

    @property
    def failures(self) -> list[AttachResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        ok = sum(r.ok for r in self.results)
        return f"{ok}/{len(self.results)} hooks attached"


@dataclass
class _Pending:
    plugin: str
    patch: PatchSpec
    original: Any = None
    checker: Callable[[], bool] | None = None
    error: str = ""


class Attacher:
    """Registers patches, applies them once, then checks each one."""

    def __init__(self, registry: HookRegistryLike) -> None:
        self.registry = registry
        self._pending: list[_Pending] = []
        self.attached_targets: set[tuple[str, str, str, str]] = set()

    def add(self, plugin: str, patches: tuple[PatchSpec, ...] | list[PatchSpec]) -> None:
        for patch in patches:
            # one plugin may hook a target twice (BEFORE and AFTER): the key is the whole patch
            key = (plugin, patch.target, patch.kind, patch.impl)
            if key in self.attached_targets:
                continue  # idempotent: a second registration in the same process is a no-op
            self.attached_targets.add(key)
            item = _Pending(plugin, patch)
            self._pending.append(item)
            try:
                if patch.kind == "registry":
                    resolve_target(patch.target)
                    checker = resolve_impl(patch.impl)()
                    item.checker = checker if callable(checker) else None
                else:
                    item.original = resolve_target(patch.target)
                    self.registry.register(patch.target, resolve_impl(patch.impl), patch.kind)
            except Exception as exc:  # noqa: BLE001 - any failure is reported per target
                item.error = f"{type(exc).__name__}: {exc}"

    def apply_and_verify(self) -> AttachReport:
        self.registry.apply()
        report = AttachReport()
        for item in self._pending:
            report.results.append(self._check(item))
        self._pending.clear()
        return report

    @staticmethod
    def _check(item: _Pending) -> AttachResult:
        p = item.patch
        if item.error:
            return AttachResult(item.plugin, p.target, p.kind, False, item.error)
        if p.kind == "registry":
            if item.checker is None:
                return AttachResult(item.plugin, p.target, p.kind, False, "registration returned no checker")
            try:
                ok = bool(item.checker())
            except Exception as exc:  # noqa: BLE001
                return AttachResult(item.plugin, p.target, p.kind, False, f"checker raised {exc!r}")
            return AttachResult(item.plugin, p.target, p.kind, ok, "" if ok else "registry does not hold it")
        try:
            current = resolve_target(p.target)
        except Exception as exc:  # noqa: BLE001
            return AttachResult(item.plugin, p.target, p.kind, False, f"no longer resolves: {exc}")
        if current is item.original:
            return AttachResult(item.plugin, p.target, p.kind, False, "target is not wrapped (hook not applied)")
        return AttachResult(item.plugin, p.target, p.kind, True)
