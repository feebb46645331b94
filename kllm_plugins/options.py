"""Layer: host core (no SGLang import). One place that maps CLI flags, environment variables
and YAML keys onto each plugin's options.

Precedence: CLI > environment (`KLLM_<PLUGIN>_<OPTION>`) > YAML (`KLLM_CONFIG` file or
`--kllm-config`) > the option's default. The CLI layer writes what it parsed back into the
environment so SGLang's spawned subprocesses, which load plugins before they see the server
arguments, resolve the same values.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

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
    unknown = set(yaml_values) - {o.name for o in spec.options}
    if unknown:
        raise KllmConfigError(
            f"kllm: unknown YAML key(s) {sorted(unknown)} for plugin {spec.name!r}; valid: {[o.name for o in spec.options]}"
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
