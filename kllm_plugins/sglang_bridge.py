"""Layer: SGLang adapter of the host. The single entry point in SGLang's `sglang.srt.plugins` group.

SGLang calls `register()` in every process (launcher, scheduler, detokenizer, DP controller).
The selection comes from `KLLM_PLUGINS` (and, in the launcher, from `--enable-plugin`, which
the CLI hook mirrors into the environment before SGLang spawns its children). Each enabled
plugin's patches are registered, applied and verified here; one INFO line per process says
what attached. With `KLLM_STRICT=1` any failure stops the process with a one-line message.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Mapping

import kllm_plugins
from kllm_plugins import runtime
from kllm_plugins.attach import Attacher, AttachReport
from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import ENV_SELECTION, EnabledPlugin, KllmPluginManager
from kllm_plugins.options import load_yaml_config
from kllm_plugins.platform_patches import selected_platform_groups
from kllm_plugins.spec import PatchSpec

logger = logging.getLogger("kllm")

HOST_PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.add_cli_args",
        impl="kllm_plugins.sglang_cli:after_add_cli_args",
        kind="after",
        why="adds --enable-plugin, --kllm-config and every plugin option to SGLang's parser",
        upstream="a parser-extension hook in sglang.srt.plugins (plugins contributing CLI args)",
    ),
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.from_cli_args",
        impl="kllm_plugins.sglang_cli:around_from_cli_args",
        kind="around",
        why="reads our flags (ServerArgs drops unknown ones), mirrors them into the environment "
        "for spawned subprocesses and enables the chosen plugins in the launcher",
        upstream="ServerArgs carrying plugin-owned options to subprocesses",
    ),
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.resolve_once",
        impl="kllm_plugins.sglang_cli:before_resolve_once",
        kind="before",
        why="lets enabled plugins select an SGLang feature they need that the user left unset "
        "(kllm_select_features), while the record is still the user's input",
        upstream="a plugin hook in SGLang's server-argument resolution pipeline",
    ),
    PatchSpec(
        target="sglang.srt.server_args.ServerArgs.resolve_once",
        impl="kllm_plugins.sglang_cli:after_resolve_once",
        kind="after",
        why="asks each enabled plugin whether the resolved arguments turn on what it attaches to "
        "(kllm_readiness): an inert plugin is logged once and shown in /kllm/plugins, or stops "
        "start-up under KLLM_STRICT=1, before any model loads",
        upstream="a plugin hook in SGLang's server-argument resolution pipeline",
    ),
)


class SGLangHookRegistry:
    """`HookRegistryLike` over SGLang's HookRegistry."""

    def register(self, target: str, fn: Callable[..., Any], kind: str) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(target, fn, HookType[kind.upper()])

    def apply(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()


def _setup_logging() -> None:
    # The scheduler calls load_plugins() before SGLang configures logging; give our root
    # logger its own handler so the activation line is never lost.
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s kllm pid=%(process)d] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    level = os.environ.get("KLLM_LOG_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))


class Host:
    """The per-process host: plugin manager, attacher and the enabled plugins."""

    def __init__(self, manager: KllmPluginManager | None = None) -> None:
        self.manager = manager or KllmPluginManager()
        self.attacher = Attacher(SGLangHookRegistry())
        self.enabled: dict[str, EnabledPlugin] = {}
        self.reports: list[AttachReport] = []
        self.role = runtime.process_role()
        self._announced = False
        self.inert: dict[str, str] = {}
        """Enabled plugins that will do nothing with this server's arguments, and why (launcher)."""
        self._features_selected = False
        self._readiness_checked = False
        self._warned: set[str] = set()

    def attach_host_patches(self) -> None:
        """The host's own patches, then the selected platform's (`platform_patches.py`)."""
        self.attacher.add("kllm", HOST_PATCHES)
        for group, patches in selected_platform_groups():
            self.attacher.add(group, patches)
        self._finish(self.attacher.apply_and_verify(), [])

    def enable(self, selection: list[str], cli_values: Mapping[str, Any] | None = None) -> list[str]:
        """Build configs for `selection`, attach the plugins not yet attached, verify, activate."""
        built = self.manager.build(selection, cli_values or {}, os.environ, load_yaml_config(None))
        if self.role == "main":
            for msg in self.manager.warnings:
                self.warn_once(msg)
        new = [ep for ep in built if ep.spec.name not in self.enabled]
        for ep in built:
            self.enabled[ep.spec.name] = ep
            runtime.set_config(ep.spec.name, ep.config)
        for ep in new:
            self.attacher.add(ep.spec.name, ep.spec.patches)
        report = self.attacher.apply_and_verify()
        self._finish(report, [ep.spec.name for ep in new])
        self.manager.activate(new, self.role)
        return [ep.spec.name for ep in new]

    def warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning("%s", msg)

    def select_features(self, server_args: Any) -> None:
        """Before SGLang resolves the launcher's server arguments: `kllm_select_features`, once."""
        if self.role != "main" or self._features_selected:
            return
        self._features_selected = True
        for name, msg in self.manager.select_features(list(self.enabled.values()), server_args):
            logger.info("kllm: %s: %s", name, msg)

    def check_readiness(self, resolved: Any) -> None:
        """After resolution, before any model loads: `kllm_readiness`, once. Inert plugins are
        warned about (once) and recorded; under KLLM_STRICT=1 start-up stops."""
        if self.role != "main" or self._readiness_checked:
            return
        self._readiness_checked = True
        self.inert = self.manager.readiness(list(self.enabled.values()), resolved)
        for name, reason in self.inert.items():
            self.warn_once(f"kllm: plugin {name!r} is enabled but inert: {reason}")
        if self.inert and runtime.strict():
            name, reason = next(iter(self.inert.items()))
            more = f" (and {len(self.inert) - 1} more)" if len(self.inert) > 1 else ""
            raise SystemExit(f"error: KLLM_STRICT=1 and plugin {name!r} would do nothing: {reason}{more}")

    def plugin_states(self) -> dict[str, str]:
        """Each enabled plugin: "active", or "inert: <reason>"."""
        return {name: f"inert: {self.inert[name]}" if name in self.inert else "active" for name in self.enabled}

    def _finish(self, report: AttachReport, new_names: list[str]) -> None:
        self.reports.append(report)
        total_ok = sum(r.ok for rep in self.reports for r in rep.results)
        total = sum(len(rep.results) for rep in self.reports)
        if new_names or (self.role != "main" and not self._announced and report is not self.reports[0]):
            self._announced = True
            logger.info(
                "kllm-plugins %s active (role=%s, pid=%d): plugins=[%s], hooks applied %d/%d",
                kllm_plugins.__version__,
                self.role,
                os.getpid(),
                ",".join(self.enabled),
                total_ok,
                total,
            )
        for fail in report.failures:
            logger.error("kllm: %s hook on %s did not attach: %s", fail.plugin, fail.target, fail.reason)
        if report.failures and runtime.strict():
            first = report.failures[0]
            raise SystemExit(
                f"kllm: KLLM_STRICT=1 and {len(report.failures)} hook(s) failed to attach; "
                f"first: plugin {first.plugin!r} target {first.target} ({first.reason})"
            )


_host: Host | None = None


def host() -> Host:
    global _host
    if _host is None:
        _host = Host()
    return _host


def register() -> None:
    """SGLang entry point (`sglang.srt.plugins`: kllm). Runs once per SGLang process."""
    _setup_logging()
    h = host()
    try:
        h.attach_host_patches()
        h.enable(h.manager.selection_from_env())
    except KllmConfigError as exc:
        if runtime.strict() or h.role == "main":
            # SystemExit is not swallowed by SGLang's loader: the user sees exactly one line.
            raise SystemExit(str(exc)) from None
        logger.error("%s (plugins disabled in this process)", exc)


def selection_env(names: list[str]) -> dict[str, str]:
    return {ENV_SELECTION: ",".join(names)}
