"""Layer: host core (no SGLang import). The suite's own extension API, as pluggy hook specs.

A capability plugin is a module (or object) that implements some of these hooks and is
registered under the `kllm_plugins` entry-point group (built-in plugins are listed in
pyproject.toml the same way as third-party ones). `KllmPluginManager` calls `check_pending()`
so a misspelled `kllm_*` implementation fails at start-up.
"""
from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "kllm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kllm_declare() -> Any:
    """Declare the plugin: return a `kllm_plugins.spec.PluginSpec`.

    Called once per process when the manager loads plugins, whether or not the plugin is
    enabled (so `--help` and `doctor` can list it). Must be cheap and must not import SGLang.
    """


@hookspec
def kllm_validate(config: Any, enabled: list[str]) -> None:
    """Cross-check a plugin's config against the other enabled plugins.

    Called after every enabled plugin's config is built. Raise ValueError with a one-line
    message to refuse the combination; the host turns it into a start-up error.
    """


@hookspec
def kllm_activate(config: Any, role: str) -> None:
    """Called in each SGLang process after this plugin's patches are applied and verified.

    `role` is "main" or "subprocess". Use it to start per-process state (metrics, publishers).
    Only enabled plugins are called.
    """


@hookspec
def kllm_select_features(config: Any, server_args: Any) -> Any:
    """Select an SGLang feature the plugin needs that the user left unset (launcher only).

    Called once in the launcher, with SGLang's `ServerArgs` record just before SGLang resolves
    it (its fields are still the user's input and may be assigned). Only do what cannot
    surprise the user: fill a field left at its default, never override one the user set. Return
    one line saying what was selected (the host logs it), or None.
    """


@hookspec
def kllm_readiness(config: Any, server_args: Any) -> Any:
    """Say whether the plugin will do anything with these server arguments (launcher only).

    Called once in the launcher after SGLang resolved its server arguments and before any
    model loads; `server_args` reads the resolved values by attribute. Return None when the
    SGLang features the plugin attaches to are on, else a one-line reason naming the flags that
    would make it work. The host logs it once as a warning, shows `inert: <reason>` in
    `GET /kllm/plugins`, and under `KLLM_STRICT=1` stops start-up with it. Must not import SGLang
    (read attributes only).
    """
