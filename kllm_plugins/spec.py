"""Layer: host core (no SGLang import). What a capability plugin declares about itself.

A plugin describes, as plain data, its options and every SGLang target it patches. The host
turns options into CLI flags, environment variables and YAML keys, and turns patches into
SGLang HookRegistry registrations that it then verifies. Keeping the patch ledger as data lets
`kllm-plugins doctor` and the tests resolve each target without running the plugin.

Options are declared once, on the plugin's config dataclass: each field made with `option()`
carries its help, choices (a `Literal` type) and range in its metadata; `options_from_config`
derives the `OptionSpec`s and `check_config` (called from the config's `__post_init__`) applies
the ranges and choices.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import kllm_plugins

PatchKind = Literal["before", "after", "around", "replace", "registry"]
Status = Literal["stable", "experimental", "planned"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class OptionSpec:
    """One option of a plugin.

    `name` is snake_case; the host exposes it as `--kllm-<plugin>-<name>` (dashes), as the
    environment variable `KLLM_<PLUGIN>_<NAME>` and as the YAML key `<plugin>.<name>`.
    `type` converts a string (CLI, environment) into the value; it raises ValueError on bad input.
    """

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"OptionSpec.name must be snake_case, got {self.name!r}")
        if self.choices is not None and self.default is not None and self.default not in self.choices:
            raise ValueError(f"OptionSpec.default {self.default!r} is not one of choices {list(self.choices)}")


@dataclass(frozen=True)
class PatchSpec:
    """One attachment to SGLang, with the reason it exists.

    target:   dotted SGLang path (for kind="registry": a dotted path that must resolve, e.g. the
              registry function the plugin calls).
    impl:     "module:attr" of our function (resolved lazily, only inside SGLang processes).
              For kind="registry" it is a zero-argument callable that performs the registration
              and returns a zero-argument checker that tells whether it took effect.
    why:      why SGLang needs patching here.
    upstream: the upstream change that would let us drop the patch.
    upstream_pr: link to the upstream pull request or issue that proposes that change ("" = none yet).
    sglang:   the SGLang version range the target and its behaviour were checked against.
    """

    target: str
    impl: str
    kind: PatchKind
    why: str
    upstream: str = ""
    upstream_pr: str = ""
    sglang: str = kllm_plugins.SGLANG_RANGE

    def __post_init__(self) -> None:
        if "." not in self.target:
            raise ValueError(f"PatchSpec.target must be a dotted path, got {self.target!r}")
        if ":" not in self.impl:
            raise ValueError(f"PatchSpec.impl must be 'module:attr', got {self.impl!r}")
        if self.kind not in ("before", "after", "around", "replace", "registry"):
            raise ValueError(f"PatchSpec.kind must be before/after/around/replace/registry, got {self.kind!r}")


@dataclass(frozen=True)
class PluginSpec:
    """Everything the host needs to know about one capability plugin.

    config_factory builds the plugin's frozen config from a dict of option values already
    converted by each OptionSpec.type; it raises ValueError naming the field on bad values.
    """

    name: str
    summary: str
    status: Status
    options: tuple[OptionSpec, ...] = ()
    patches: tuple[PatchSpec, ...] = ()
    config_factory: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"PluginSpec.name must be snake_case, got {self.name!r}")
        names = [o.name for o in self.options]
        if len(names) != len(set(names)):
            raise ValueError(f"PluginSpec.options of {self.name!r} has duplicate names: {names}")


def parse_bool(text: str) -> bool:
    """Option type for booleans given as text (CLI, environment, YAML)."""
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0), got {text!r}")


OPTION_KEY = "kllm_option"  # the key of an option's declaration in a dataclass field's metadata


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A config dataclass field that declares its option: `help` (one line, for `--help`, `list`
    and the docs), `parse` (text to value, where the field's type is not bool, int, float, str or
    a `Literal` of them), and range bounds that `check_config` applies."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata={OPTION_KEY: {"help": help, "parse": parse, **bounds}})


def _field_type(cls: type, f: dataclasses.Field[Any], hints: Mapping[str, Any]
                ) -> tuple[Callable[[str], Any], tuple[Any, ...] | None]:
    meta = f.metadata.get(OPTION_KEY, {})
    hint = hints.get(f.name, f.type)
    choices = None
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        hint = type(choices[0])
    if meta.get("parse") is not None:
        return meta["parse"], choices
    if hint is bool:
        return parse_bool, choices
    if hint in (int, float, str):
        return hint, choices
    raise TypeError(f"{cls.__name__}.{f.name}: type {hint!r} needs option(parse=...) to read it from text")


def options_from_config(cls: type, help: Mapping[str, str] | None = None) -> tuple[OptionSpec, ...]:
    """One `OptionSpec` per field of the config dataclass `cls`, in field order: the type from the
    annotation (bool parsed as text, a `Literal` gives the choices), the default from the field,
    the help from `option()` metadata (or `help[name]`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(OPTION_KEY, {})
        text = meta.get("help") or (help or {}).get(f.name)
        if not text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with option(default, help)")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default: every option needs one")
        conv, choices = _field_type(cls, f, hints)
        out.append(OptionSpec(f.name, conv, f.default, text, choices=choices))
    return tuple(out)


def _interval(meta: Mapping[str, Any]) -> str:
    lo = f"[{meta['ge']}" if "ge" in meta else f"({meta['gt']}"
    hi = f"{meta['le']}]" if "le" in meta else f"{meta['lt']})"
    return f"in {lo}, {hi}"


def check_config(config: Any) -> None:
    """Apply the ranges (`option(ge=, gt=, le=, lt=)`) and `Literal` choices of a config
    dataclass's fields; ValueError naming the first field out of range."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        hint = hints.get(f.name)
        if typing.get_origin(hint) is Literal and v not in typing.get_args(hint):
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, typing.get_args(hint)))}, got {v!r}")
        meta = f.metadata.get(OPTION_KEY, {})
        low = "ge" in meta or "gt" in meta
        high = "le" in meta or "lt" in meta
        ok = (("ge" not in meta or v >= meta["ge"]) and ("gt" not in meta or v > meta["gt"])
              and ("le" not in meta or v <= meta["le"]) and ("lt" not in meta or v < meta["lt"]))
        if ok:
            continue
        if low and high:
            raise ValueError(f"{f.name} must be {_interval(meta)}, got {v}")
        op, bound = next((o, meta[k]) for k, o in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta)
        raise ValueError(f"{f.name} must be {op} {bound}, got {v}")
