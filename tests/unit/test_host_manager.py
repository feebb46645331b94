"""The plugin manager: discovery, selection, option precedence, one-line errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kllm_plugins.errors import KllmConfigError
from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.options import load_yaml_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import kllm_test_plugins as tp  # noqa: E402


def make(clean_env: pytest.MonkeyPatch) -> KllmPluginManager:
    return KllmPluginManager(extra_plugins=[("picky", tp.picky)])


def test_builtin_trace_is_found_through_entry_point(clean_env: pytest.MonkeyPatch) -> None:
    manager = KllmPluginManager()
    assert "trace" in manager.names()
    assert manager.specs["trace"].patches, "trace declares its SGLang targets"


def test_unknown_name_lists_valid_choices(clean_env: pytest.MonkeyPatch) -> None:
    manager = make(clean_env)
    with pytest.raises(KllmConfigError) as err:
        manager.parse_selection(["trace,nope"])
    msg = str(err.value)
    assert "'nope'" in msg and "picky" in msg and "trace" in msg and "\n" not in msg


def test_selection_accepts_commas_repeats_and_dashes(clean_env: pytest.MonkeyPatch) -> None:
    manager = make(clean_env)
    assert manager.parse_selection(["trace, picky", "trace"]) == ["trace", "picky"]
    clean_env.setenv("KLLM_PLUGINS", "picky")
    assert manager.selection_from_env() == ["picky"]


def test_option_precedence_cli_env_yaml_default(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    manager = make(clean_env)
    assert manager.build(["picky"])[0].config.level == 1  # default
    yaml_file = tmp_path / "k.yaml"
    yaml_file.write_text("picky:\n  level: 2\n")
    yaml_values = load_yaml_config(str(yaml_file))
    assert manager.build(["picky"], yaml_values=yaml_values)[0].config.level == 2
    env = {"KLLM_PICKY_LEVEL": "0"}
    assert manager.build(["picky"], environ=env, yaml_values=yaml_values)[0].config.level == 0
    cli = {"kllm_picky_level": "3"}
    assert manager.build(["picky"], cli_values=cli, environ=env, yaml_values=yaml_values)[0].config.level == 3


def test_bad_values_are_one_line_errors(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    manager = make(clean_env)
    with pytest.raises(KllmConfigError, match="KLLM_PICKY_LEVEL"):
        manager.build(["picky"], environ={"KLLM_PICKY_LEVEL": "high"})
    with pytest.raises(KllmConfigError, match=r"level must be in \[0, 3\]"):
        manager.build(["picky"], environ={"KLLM_PICKY_LEVEL": "9"})
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("picky:\n  levle: 2\n")
    with pytest.raises(KllmConfigError, match="unknown YAML key"):
        manager.build(["picky"], yaml_values=load_yaml_config(str(bad_yaml)))


def test_validate_hook_refuses_combination(clean_env: pytest.MonkeyPatch) -> None:
    manager = make(clean_env)
    manager.build(["picky", "trace"], environ={"KLLM_PICKY_LEVEL": "2"})
    with pytest.raises(KllmConfigError, match="cannot be combined with trace"):
        manager.build(["picky", "trace"], environ={"KLLM_PICKY_LEVEL": "3"})


def test_misspelled_hook_implementation_fails_at_startup(clean_env: pytest.MonkeyPatch) -> None:
    class Misspelled:
        @hookimpl
        def kllm_declar(self) -> None:  # typo on purpose
            return None

    with pytest.raises(KllmConfigError, match="kllm_declar"):
        KllmPluginManager(extra_plugins=[("typo", Misspelled())], load_entry_points=False)


def test_extra_plugins_from_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KLLM_EXTRA_PLUGINS", "kllm_test_plugins:picky")
    assert "picky" in KllmPluginManager(load_entry_points=False).names()
    clean_env.setenv("KLLM_EXTRA_PLUGINS", "kllm_test_plugins:nothing_here")
    with pytest.raises(KllmConfigError, match="nothing_here"):
        KllmPluginManager(load_entry_points=False)


def test_duplicate_plugin_names_rejected(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(KllmConfigError, match="two plugins declare"):
        KllmPluginManager(extra_plugins=[("a", tp.Picky()), ("b", tp.Picky())], load_entry_points=False)


def test_extra_plugin_already_installed_is_not_registered_twice(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KLLM_EXTRA_PLUGINS", "kllm_plugins.plugins.trace.hookimpls")
    manager = KllmPluginManager()
    assert manager.names().count("trace") == 1


def test_bool_typed_option_parses_false_text_as_false() -> None:
    from kllm_plugins.errors import KllmConfigError
    from kllm_plugins.options import convert
    from kllm_plugins.spec import OptionSpec

    opt = OptionSpec("flag", bool, True, "a flag")
    assert convert("p", opt, "false", "--kllm-p-flag") is False
    assert convert("p", opt, "1", "--kllm-p-flag") is True
    assert convert("p", opt, False, "yaml p.flag") is False
    with pytest.raises(KllmConfigError, match="expected a boolean"):
        convert("p", opt, "maybe", "--kllm-p-flag")
