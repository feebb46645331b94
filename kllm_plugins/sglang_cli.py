"""Layer: SGLang adapter of the host. Hooks on SGLang's argument parsing.

`--enable-plugin NAME[,NAME...]` (repeatable), `--kllm-config FILE` and each plugin's
`--kllm-<plugin>-<option>` appear in `python -m sglang.launch_server --help`. Bad names and
values are argparse errors (one line, exit 2) that list the valid choices.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import kllm_plugins
from kllm_plugins import runtime, stats
from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import ENV_SELECTION
from kllm_plugins.options import ENV_CONFIG_FILE, cli_dest, cli_flag, convert, env_name


def _host():
    from kllm_plugins.sglang_bridge import host

    return host()


def _argparse_type(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        try:
            fn(text)
        except KllmConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("kllm: ")) from None
        return text

    checked.__name__ = getattr(fn, "__name__", "value")
    return checked


def after_add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    manager = _host().manager
    if any("--enable-plugin" in a.option_strings for a in parser._actions):
        return None
    group = parser.add_argument_group("kllm-plugins", "Plugins from the kllm-plugins suite")
    group.add_argument(
        "--enable-plugin",
        action="append",
        default=None,
        type=_argparse_type(manager.parse_selection),
        metavar="NAME[,NAME...]",
        help=f"Enable kllm plugins (also read from ${ENV_SELECTION}). Available: {', '.join(manager.names())}.",
    )
    group.add_argument("--kllm-config", default=None, help=f"YAML file of plugin options (also ${ENV_CONFIG_FILE}).")
    for name in manager.names():
        spec = manager.specs[name]
        for opt in spec.options:
            flag = cli_flag(name, opt.name)
            group.add_argument(
                flag,
                dest=cli_dest(name, opt.name),
                default=None,
                type=_argparse_type(lambda t, o=opt, f=flag, n=name: convert(n, o, t, f)),
                choices=None,
                help=f"[{name}] {opt.help} (default: {opt.default}; env {env_name(name, opt.name)})",
            )
    return None


def around_from_cli_args(original: Callable[..., Any], cls: Any, args: argparse.Namespace) -> Any:
    server_args = original(cls, args)
    h = _host()
    if getattr(args, "kllm_config", None):
        os.environ[ENV_CONFIG_FILE] = os.path.abspath(args.kllm_config)
    cli_values: dict[str, Any] = {}
    for name, spec in h.manager.specs.items():
        for opt in spec.options:
            value = getattr(args, cli_dest(name, opt.name), None)
            if value is not None:
                cli_values[cli_dest(name, opt.name)] = value
                os.environ[env_name(name, opt.name)] = str(value)
    try:
        if getattr(args, "enable_plugin", None):
            selection = h.manager.parse_selection(args.enable_plugin)
            os.environ[ENV_SELECTION] = ",".join(selection)
        else:
            selection = h.manager.selection_from_env()
        h.enable(selection, cli_values)
    except KllmConfigError as exc:
        raise SystemExit(f"error: {str(exc).removeprefix('kllm: ')}") from None
    runtime.run_dir()  # sets KLLM_RUN_DIR before SGLang spawns its children
    install_http_routes()
    # Bookkeeping attribute (not a msgspec field): pickled with the record into subprocesses.
    server_args._kllm_plugins = list(selection)
    return server_args


def before_resolve_once(self: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `ServerArgs.resolve_once`: plugins select what they need (first record, launcher)."""
    if not getattr(self, "_resolution_finished", False) and not getattr(self, "_resolution_failed", False):
        _host().select_features(self)
    return None


def after_resolve_once(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `ServerArgs.resolve_once`: each enabled plugin's readiness (first record, launcher)."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    _host().check_readiness(resolved_view(self))
    return result


def install_http_routes() -> None:
    """Add GET /kllm/stats and GET /kllm/plugins to SGLang's FastAPI app (launcher only)."""
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    if any(getattr(route, "path", None) == "/kllm/stats" for route in app.routes):
        return

    async def kllm_stats() -> dict[str, Any]:
        return stats.read_all()

    async def kllm_plugins_info() -> dict[str, Any]:
        h = _host()
        return {
            "version": kllm_plugins.__version__,
            "enabled": list(h.enabled),
            "state": h.plugin_states(),
            "available": h.manager.names(),
            "hooks": [
                {"plugin": r.plugin, "target": r.target, "kind": r.kind, "ok": r.ok, "reason": r.reason}
                for rep in h.reports
                for r in rep.results
            ],
        }

    app.add_api_route("/kllm/stats", kllm_stats, methods=["GET"])
    app.add_api_route("/kllm/plugins", kllm_plugins_info, methods=["GET"])
