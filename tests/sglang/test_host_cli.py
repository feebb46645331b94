"""Real SGLang, no server: our flags in --help, one-line start-up errors, doctor, the platform."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

SUPPORT = str(Path(__file__).resolve().parents[1] / "support")


def run(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLLM_") and k != "SGLANG_USE_CPU_ENGINE"}
    env.update({"SGLANG_PLATFORM": "kllm_cpu", "KLLM_STRICT": "1", "PYTHONPATH": SUPPORT})
    env.update(env_extra or {})
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def launch(*extra: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent-model", *extra], env_extra)


def test_help_lists_enable_plugin_and_plugin_options() -> None:
    out = run([sys.executable, "-m", "sglang.launch_server", "--help"])
    assert out.returncode == 0, out.stderr[-1500:]
    assert "--enable-plugin" in out.stdout and "--kllm-config" in out.stdout
    assert "--kllm-trace-log-interval-s" in out.stdout and "KLLM_TRACE_LOG_INTERVAL_S" in out.stdout


def test_unknown_plugin_is_one_line_error_with_choices() -> None:
    out = launch("--enable-plugin", "trace,nosuch")
    assert out.returncode == 2
    err_lines = [l for l in out.stderr.splitlines() if "error" in l]
    assert len(err_lines) == 1 and "'nosuch'" in err_lines[0]
    choices = err_lines[0].split("valid choices: ")[1]
    assert "trace" in choices.split(", ")
    assert "Traceback" not in out.stderr


def test_bad_option_value_is_one_line_error() -> None:
    out = launch("--enable-plugin", "trace", "--kllm-trace-publish-interval-s", "soon")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--kllm-trace-publish-interval-s" in out.stderr
    # a value the type accepts but the config refuses
    out = launch("--enable-plugin", "trace", "--kllm-trace-publish-interval-s", "-1")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "publish_interval_s must be in (0, 60]" in out.stderr


def test_unknown_plugin_in_environment_fails_fast() -> None:
    out = launch(env_extra={"KLLM_PLUGINS": "nosuch"})
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "unknown plugin 'nosuch'; valid choices: " in out.stderr and "trace" in out.stderr


def test_wrong_target_fails_startup_under_strict() -> None:
    extra = {"KLLM_EXTRA_PLUGINS": "kllm_test_plugins:broken_target"}
    out = launch("--enable-plugin", "broken_target", env_extra=extra)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "KLLM_STRICT=1 and 1 hook(s) failed to attach" in out.stderr
    assert "no_such_method_kllm" in out.stderr


def test_wrong_target_only_logged_without_strict() -> None:
    extra = {"KLLM_EXTRA_PLUGINS": "kllm_test_plugins:broken_target", "KLLM_STRICT": "0"}
    out = launch("--enable-plugin", "broken_target", env_extra=extra)
    # startup goes on past our hooks and then fails on the missing model, not on us
    assert "did not attach" in out.stderr
    assert "KLLM_STRICT=1" not in out.stderr


def test_doctor_resolves_every_target() -> None:
    out = run([sys.executable, "-m", "kllm_plugins.cli", "doctor"])
    assert out.returncode == 0, out.stdout[-2000:]
    assert "SGLang: 0.5." in out.stdout
    assert "Scheduler.get_next_batch_to_run: ok" in out.stdout and "0 problem(s)" in out.stdout


def test_doctor_flags_missing_target() -> None:
    out = run([sys.executable, "-m", "kllm_plugins.cli", "doctor"], {"KLLM_EXTRA_PLUGINS": "kllm_test_plugins:broken_target"})
    assert out.returncode == 1 and "no_such_method_kllm: MISSING" in out.stdout


def test_sglang_resolves_our_cpu_platform() -> None:
    code = "from sglang.srt.platforms import current_platform as p; print(type(p).__name__, p.get_default_attention_backend(), p.get_device())"
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.split()[-3:] == ["KllmCpuPlatform", "torch_native", "cpu"]
