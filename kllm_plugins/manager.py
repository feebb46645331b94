"""Layer: host core (no SGLang import). Finds plugins, parses the selection, builds configs.

Plugins come from the `kllm_plugins` entry-point group (built-in ones are declared there too).
The manager rejects misspelled hook implementations (`check_pending`), unknown plugin names
and bad option values with one-line `KllmConfigError`s that name the valid choices.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Iterable, Mapping

import pluggy

from kllm_plugins import hookspecs
from kllm_plugins.errors import KllmConfigError
from kllm_plugins.options import name_problems, resolve_options
from kllm_plugins.spec import PluginSpec

logger = logging.getLogger("kllm.manager")

ENTRY_POINT_GROUP = "kllm_plugins"
ENV_SELECTION = "KLLM_PLUGINS"
ENV_EXTRA = "KLLM_EXTRA_PLUGINS"
"""Comma-separated `module` or `module:attr` plugins registered without packaging (tests, prototypes)."""


@dataclass(frozen=True)
class EnabledPlugin:
    spec: PluginSpec
    config: Any


class KllmPluginManager:
    """Owns the pluggy manager and the declared specs of every available plugin."""

    def __init__(self, extra_plugins: Iterable[tuple[str, object]] = (), load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if load_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                if self.pm.get_plugin(ep.name) is None:
                    self.pm.register(ep.load(), name=ep.name)
        for ref in filter(None, (m.strip() for m in os.environ.get(ENV_EXTRA, "").split(","))):
            if self.pm.get_plugin(ref) is None:
                module, _, attr = ref.partition(":")
                try:
                    obj: object = importlib.import_module(module)
                    for part in filter(None, attr.split(".")):
                        obj = getattr(obj, part)
                except (ImportError, AttributeError) as exc:
                    raise KllmConfigError(f"kllm: cannot load {ENV_EXTRA} entry {ref!r}: {exc}") from None
                if not self.pm.is_registered(obj):  # already known through its entry point
                    self.pm.register(obj, name=ref)
        for name, obj in extra_plugins:
            if not self.pm.is_registered(obj):
                self.pm.register(obj, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise KllmConfigError(f"kllm: invalid plugin implementation: {exc}") from None
        self.specs: dict[str, PluginSpec] = {}
        self.warnings: list[str] = []
        self._objects_by_name: dict[str, object] = {}
        for plugin in self.pm.get_plugins():
            if not self._implements(plugin, "kllm_declare"):
                continue
            spec = self._call(plugin, "kllm_declare")
            if not isinstance(spec, PluginSpec):
                raise KllmConfigError(
                    f"kllm: plugin {self.pm.get_name(plugin)!r} kllm_declare() returned {type(spec).__name__}, not PluginSpec"
                )
            if spec.name in self.specs:
                raise KllmConfigError(f"kllm: two plugins declare the name {spec.name!r}")
            self.specs[spec.name] = spec
            self._objects_by_name[spec.name] = plugin

    def _implements(self, plugin: object, hook: str) -> bool:
        return any(impl.plugin is plugin for impl in getattr(self.pm.hook, hook).get_hookimpls())

    def _call(self, plugin: object, hook: str, **kwargs: Any) -> Any:
        """`plugin`'s implementation of `hook`, called through pluggy (`pm.hook`, restricted to that
        plugin: each gets its own config); None when it implements none."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        results = self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)
        return results[0] if results else None

    def names(self) -> list[str]:
        return sorted(self.specs)

    def parse_selection(self, values: Iterable[str] | str | None) -> list[str]:
        """Turn `--enable-plugin a,b --enable-plugin c` or "a,b" into a checked, ordered list."""
        if values is None:
            return []
        if isinstance(values, str):
            values = [values]
        out: list[str] = []
        for value in values:
            for name in str(value).split(","):
                name = name.strip().replace("-", "_")
                if not name:
                    continue
                if name not in self.specs:
                    raise KllmConfigError(
                        f"kllm: unknown plugin {name!r}; valid choices: {', '.join(self.names()) or '(none installed)'}"
                    )
                if name not in out:
                    out.append(name)
        return out

    def selection_from_env(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        return self.parse_selection(environ.get(ENV_SELECTION, ""))

    def build(
        self,
        selection: list[str],
        cli_values: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] = os.environ,
        yaml_values: Mapping[str, Any] | None = None,
    ) -> list[EnabledPlugin]:
        """Build each selected plugin's config (CLI > environment > YAML > default) and cross-validate.

        Misspelt or misplaced option names (`options.name_problems`) are errors; the warnings
        (names of plugins that are not enabled) are left in `self.warnings` for the caller to log.
        """
        errors, self.warnings = name_problems(self.specs, list(selection), cli_values or {}, environ, yaml_values or {})
        if errors:
            raise KllmConfigError(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        enabled: list[EnabledPlugin] = []
        for name in selection:
            spec = self.specs[name]
            values = resolve_options(spec, cli_values or {}, environ, (yaml_values or {}).get(name) or {})
            config: Any = values
            if spec.config_factory is not None:
                try:
                    config = spec.config_factory(**values)
                except (TypeError, ValueError) as exc:
                    raise KllmConfigError(f"kllm: plugin {name!r}: {exc}") from None
            enabled.append(EnabledPlugin(spec, config))
        for ep in enabled:
            obj = self._objects_by_name[ep.spec.name]
            try:
                self._call(obj, "kllm_validate", config=ep.config, enabled=list(selection))
            except ValueError as exc:
                raise KllmConfigError(f"kllm: plugin {ep.spec.name!r}: {exc}") from None
        return enabled

    def activate(self, enabled: list[EnabledPlugin], role: str) -> None:
        for ep in enabled:
            self._call(self._objects_by_name[ep.spec.name], "kllm_activate", config=ep.config, role=role)

    def select_features(self, enabled: list[EnabledPlugin], server_args: Any) -> list[tuple[str, str]]:
        """`kllm_select_features` of each enabled plugin: (plugin, what it selected) for each that did."""
        out = []
        for ep in enabled:
            chosen = self._call(self._objects_by_name[ep.spec.name], "kllm_select_features", config=ep.config,
                                server_args=server_args)
            if chosen:
                out.append((ep.spec.name, str(chosen)))
        return out

    def readiness(self, enabled: list[EnabledPlugin], server_args: Any) -> dict[str, str]:
        """`kllm_readiness` of each enabled plugin: plugin -> why it would do nothing, for each inert one."""
        inert: dict[str, str] = {}
        for ep in enabled:
            reason = self._call(self._objects_by_name[ep.spec.name], "kllm_readiness", config=ep.config,
                                server_args=server_args)
            if reason:
                inert[ep.spec.name] = str(reason)
        return inert
