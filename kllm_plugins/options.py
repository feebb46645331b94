"""Layer: host core (no SGLang import). One place that maps CLI flags, environment variables
and YAML keys onto each plugin's options.

Precedence: CLI > environment (`KLLM_<PLUGIN>_<OPTION>`) > YAML (`KLLM_CONFIG` file or
`--kllm-config`) > the option's default. The CLI layer writes what it parsed back into the
environment so SGLang's spawned subprocesses, which load plugins before they see the server
arguments, resolve the same values.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Iterable, Mapping

from kllm_plugins.errors import KllmConfigError
from kllm_plugins.spec import OptionSpec, PluginSpec, parse_bool

ENV_CONFIG_FILE = "KLLM_CONFIG"


def cli_flag(plugin: str, option: str) -> str:
    return f"--kllm-{plugin.replace('_', '-')}-{option.replace('_', '-')}"


def cli_dest(plugin: str, option: str) -> str:
    return f"kllm_{plugin}_{option}"


def env_name(plugin: str, option: str) -> str:
    return f"KLLM_{plugin.upper()}_{option.upper()}"


def convert(plugin: str, opt: OptionSpec, raw: Any, where: str) -> Any:
    """Convert one raw value with the option's type, checking choices; one-line error on failure."""
    if raw is None:
        return None
    # `type=bool` would read "false" as True (a non-empty string): booleans always parse as text.
    conv = parse_bool if opt.type is bool else opt.type
    try:
        value = raw if (not isinstance(raw, str) and _already_typed(opt, raw)) else conv(str(raw))
    except (TypeError, ValueError) as exc:
        raise KllmConfigError(f"kllm: bad value {raw!r} for {where} ({opt.help}): {exc}") from None
    if opt.choices is not None and value not in opt.choices:
        raise KllmConfigError(
            f"kllm: bad value {raw!r} for {where}; valid choices: {', '.join(map(str, opt.choices))}"
        )
    return value


def _already_typed(opt: OptionSpec, raw: Any) -> bool:
    return opt.default is not None and isinstance(raw, type(opt.default))


def resolve_options(
    spec: PluginSpec,
    cli_values: Mapping[str, Any],
    environ: Mapping[str, str],
    yaml_values: Mapping[str, Any],
) -> dict[str, Any]:
    names = [o.name for o in spec.options]
    unknown = sorted(set(yaml_values) - set(names))
    if unknown:
        raise KllmConfigError(
            f"kllm: unknown YAML key(s) {unknown} for plugin {spec.name!r}{nearest(unknown[0], names)}; valid: {names}"
        )
    out: dict[str, Any] = {}
    for opt in spec.options:
        dest = cli_dest(spec.name, opt.name)
        env = env_name(spec.name, opt.name)
        if cli_values.get(dest) is not None:
            out[opt.name] = convert(spec.name, opt, cli_values[dest], cli_flag(spec.name, opt.name))
        elif env in environ:
            out[opt.name] = convert(spec.name, opt, environ[env], env)
        elif opt.name in yaml_values:
            out[opt.name] = convert(spec.name, opt, yaml_values[opt.name], f"{spec.name}.{opt.name} in YAML")
        else:
            out[opt.name] = opt.default
    return out


def load_yaml_config(path: str | None) -> dict[str, Any]:
    """Read the YAML config file: a mapping of plugin name to a mapping of option values."""
    path = path or os.environ.get(ENV_CONFIG_FILE)
    if not path:
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise KllmConfigError(f"kllm: cannot read config file {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise KllmConfigError(f"kllm: config file {path!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise KllmConfigError(f"kllm: config file {path!r} must map plugin names to option mappings")
    return data


def nearest(name: str, candidates: Iterable[str]) -> str:
    """"; nearest valid name: X" for the closest candidate, or "" when none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; nearest valid name: {match[0]}" if match else ""


def _plugin_of_env(var: str, specs: Mapping[str, PluginSpec]) -> str | None:
    """The plugin whose `KLLM_<PLUGIN>_` prefix `var` has (the longest one), or None."""
    best = None
    for name in specs:
        prefix = f"KLLM_{name.upper()}_"
        if var.startswith(prefix) and (best is None or len(name) > len(best)):
            best = name
    return best


def name_problems(
    specs: Mapping[str, PluginSpec],
    selection: list[str],
    cli_values: Mapping[str, Any],
    environ: Mapping[str, str],
    yaml_values: Mapping[str, Any],
) -> tuple[list[str], list[str]]:
    """Misspelt or misplaced option names: (errors, warnings), each a one-line message naming
    the nearest valid name.

    Errors: a `KLLM_<PLUGIN>_*` variable of an enabled plugin that matches none of its options; a
    YAML section that names no plugin, or a key that names no option of its plugin; a CLI option
    of a plugin that is not enabled. Warnings: variables and YAML sections of plugins that are
    not enabled (an environment or a config file may serve several launches).
    """
    errors: list[str] = []
    warnings: list[str] = []
    enabled = set(selection)
    on = ", ".join(selection) or "none"
    for var in sorted(environ):
        plugin = _plugin_of_env(var, specs)
        if plugin is None:
            continue
        valid = [env_name(plugin, o.name) for o in specs[plugin].options]
        if var not in valid:
            msg = f"kllm: {var} matches no option of plugin {plugin!r}{nearest(var, valid)}"
            (errors if plugin in enabled else warnings).append(msg)
        elif plugin not in enabled:
            warnings.append(f"kllm: {var} is set but plugin {plugin!r} is not enabled (enabled: {on}); it has no effect")
    for section in sorted(yaml_values):
        if section not in specs:
            errors.append(f"kllm: unknown YAML section {section!r}: names no plugin{nearest(section, specs)}; plugins: {', '.join(sorted(specs))}")
            continue
        keys = yaml_values[section] or {}
        names = [o.name for o in specs[section].options]
        for key in sorted(set(keys) - set(names)):
            errors.append(f"kllm: unknown YAML key {section}.{key}: matches no option of plugin {section!r}{nearest(key, names)}")
        if section not in enabled:
            warnings.append(f"kllm: YAML section {section!r} is given but plugin {section!r} is not enabled (enabled: {on}); it has no effect")
    for plugin, spec in sorted(specs.items()):
        if plugin in enabled:
            continue
        for opt in spec.options:
            if cli_values.get(cli_dest(plugin, opt.name)) is not None:
                errors.append(
                    f"kllm: {cli_flag(plugin, opt.name)} is an option of plugin {plugin!r}, which is not enabled "
                    f"(enabled: {on}); add {plugin} to --enable-plugin or drop the option"
                )
    return errors, warnings
