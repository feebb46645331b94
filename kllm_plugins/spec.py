"""Layer: host core (no SGLang import). What a capability plugin declares about itself.

A plugin describes, as plain data, its options and every SGLang target it patches. The host
turns options into CLI flags, environment variables and YAML keys, and turns patches into
SGLang HookRegistry registrations that it then verifies. Keeping the patch ledger as data lets
`kllm-plugins doctor` and the tests resolve each target without running the plugin.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

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
    """

    target: str
    impl: str
    kind: PatchKind
    why: str
    upstream: str = ""

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
    env: dict[str, str] = field(default_factory=dict)

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
