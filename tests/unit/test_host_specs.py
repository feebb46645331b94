"""Every installed plugin's declaration, checked the same way: its options are its config
dataclass's fields (derived with `options_from_config` or not), its config builds from the
defaults, and each ledger row's SGLang target and our implementation resolve. Also the
declaration helpers themselves (`option`, `options_from_config`, `check_config`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from kllm_plugins.attach import resolve_impl, resolve_target
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.spec import OptionSpec, PatchSpec, check_config, option, options_from_config, parse_bool


def _specs() -> dict[str, object]:
    m = KllmPluginManager()
    return {name: m.specs[name] for name in m.names()}


SPECS = _specs()


def test_the_built_in_plugins_are_installed() -> None:
    assert {"trace", "incr_prefix", "fair_sched", "kv_tiers", "bigpd_router", "ring_cp", "dspark"} <= set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_options_are_the_config_fields(name: str) -> None:
    spec = SPECS[name]
    factory = spec.config_factory  # type: ignore[attr-defined]
    assert factory is not None and dataclasses.is_dataclass(factory), f"{name}: config_factory is not a dataclass"
    fields = [f for f in dataclasses.fields(factory) if f.init]
    options = spec.options  # type: ignore[attr-defined]
    # every field is an option and every option a field, with its default (in any order)
    assert {o.name: o.default for o in options} == {f.name: f.default for f in fields}
    assert all(o.help.strip() and "\n" not in o.help for o in options), name
    defaults = {o.name: o.default for o in options}
    assert factory(**defaults) == factory()  # the declared defaults build the config the plugin gets by default


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_target_and_impl_resolves(name: str) -> None:
    pytest.importorskip("sglang")
    for patch in SPECS[name].patches:  # type: ignore[attr-defined]
        resolve_target(patch.target)
        assert callable(resolve_impl(patch.impl)), patch.impl


def test_doctor_reports_an_impl_that_does_not_resolve(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("sglang")
    from kllm_plugins import cli

    bad = PatchSpec(target="sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
                    impl="kllm_plugins.plugins.trace.sglang_adapter:no_such_function", kind="around", why="test")
    monkeypatch.setattr(cli, "_patch_groups", lambda manager: [("broken", (bad,))])
    lines, problems = cli.doctor_report(KllmPluginManager(load_entry_points=False))
    assert problems == 1
    assert any("IMPL MISSING" in line and "no_such_function" in line for line in lines), lines


# -- the declaration helpers -------------------------------------------------------------------

Mode = Literal["fast", "safe"]


def _knots(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in str(text).split(","))


@dataclass(frozen=True)
class _Demo:
    enabled: bool = option(True, "turn it on")
    count: int = option(4, "how many", ge=1, le=64)
    rate: float = option(0.5, "a rate", gt=0)
    mode: Mode = option("fast", "which mode")
    knots: tuple[int, ...] = option((1, 2), "knots", parse=_knots)

    def __post_init__(self) -> None:
        check_config(self)


def test_options_from_config_reads_types_defaults_help_and_choices() -> None:
    opts = {o.name: o for o in options_from_config(_Demo)}
    assert list(opts) == ["enabled", "count", "rate", "mode", "knots"]
    assert opts["enabled"] == OptionSpec("enabled", parse_bool, True, "turn it on")
    assert opts["count"].type is int and opts["rate"].type is float and opts["count"].default == 4
    assert opts["mode"].type is str and tuple(opts["mode"].choices) == ("fast", "safe")
    assert opts["knots"].type is _knots and opts["knots"].default == (1, 2)


def test_the_host_builds_a_derived_config_from_text(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kllm_plugins.errors import KllmConfigError
    from kllm_plugins.options import resolve_options
    from kllm_plugins.spec import PluginSpec

    spec = PluginSpec(name="demo", summary="d", status="planned", options=options_from_config(_Demo),
                      config_factory=_Demo)
    values = resolve_options(spec, {}, {"KLLM_DEMO_ENABLED": "false", "KLLM_DEMO_KNOTS": "3,4",
                                        "KLLM_DEMO_MODE": "safe"}, {})
    assert _Demo(**values) == _Demo(enabled=False, knots=(3, 4), mode="safe")
    with pytest.raises(KllmConfigError, match="valid choices: fast, safe"):
        resolve_options(spec, {}, {"KLLM_DEMO_MODE": "slow"}, {})


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "count must be in [1, 64], got 0"),
    ({"count": 65}, "count must be in [1, 64], got 65"),
    ({"rate": 0.0}, "rate must be > 0, got 0.0"),
    ({"mode": "slow"}, "mode must be one of fast, safe, got 'slow'"),
])
def test_check_config_names_the_field_and_its_range(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        _Demo(**kwargs)  # type: ignore[arg-type]
    assert str(exc.value) == message
    _Demo(count=64, rate=1e-9, mode="safe")  # the bounds themselves are in range


def test_a_field_without_help_or_a_readable_type_is_refused() -> None:
    @dataclass(frozen=True)
    class NoHelp:
        x: int = 1

    @dataclass(frozen=True)
    class Unreadable:
        x: tuple[int, ...] = option((1,), "a tuple with no parse")

    with pytest.raises(TypeError, match="NoHelp.x has no help"):
        options_from_config(NoHelp)
    assert options_from_config(NoHelp, help={"x": "given apart"})[0].help == "given apart"
    with pytest.raises(TypeError, match="needs option\\(parse=...\\)"):
        options_from_config(Unreadable)


def test_patch_spec_records_the_upstream_pr_and_the_sglang_range() -> None:
    import kllm_plugins

    p = PatchSpec(target="a.b", impl="m:f", kind="after", why="w")
    assert p.upstream_pr == "" and p.sglang == kllm_plugins.SGLANG_RANGE
    assert not hasattr(SPECS["trace"], "env")  # PluginSpec.env is gone (it was never read)
