"""The `kllm_cuda` platform is chosen only explicitly, refuses to run where it cannot (one line, no
traceback), picks the TreeCore the machine's torch can run, and logs what it chose in every
process whatever SGLang's logging state. Runs on the CPU: the GPU is simulated only where a test
says so (the platform's log line); the refusal without a GPU is the real one."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kllm_plugins.hardware.cuda import platform_entry

ROOT = Path(__file__).resolve().parents[2]
GUARD_FILE = ROOT / "hardware" / "cuda" / "distribution" / "kllm_cuda_guard.py"


def load_guard() -> ModuleType:
    """A fresh copy of the process-start guard module (not installed in this venv)."""
    spec = importlib.util.spec_from_file_location("kllm_cuda_guard_under_test", GUARD_FILE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("env,chosen", [({"SGLANG_PLATFORM": "kllm_cuda"}, True), ({}, False),
                                        ({"SGLANG_PLATFORM": "cuda"}, False), ({"SGLANG_PLATFORM": "kllm_cpu"}, False)])
def test_platform_is_selected_only_by_name(env: dict[str, str], chosen: bool) -> None:
    assert platform_entry.selected(env) is chosen
    assert load_guard().selected(env) is chosen


def test_activate_returns_none_unless_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not selected: SGLang's own CUDA platform stays the default (our activate() declines), even
    where a GPU is visible."""
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setattr(platform_entry, "_cuda_visible", lambda: True)
    assert platform_entry.activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", "cuda")
    assert platform_entry.activate() is None


GOOD_GUARD = {"installed": True, "late": []}


@pytest.mark.parametrize(
    "env,gpu,guard,needle",
    [
        ({"SGLANG_USE_CPU_ENGINE": "1"}, True, GOOD_GUARD, "unset SGLANG_USE_CPU_ENGINE"),
        ({}, False, GOOD_GUARD, "no CUDA GPU visible"),
        ({}, True, None, "process-start guard is not installed"),
        ({}, True, {"installed": False, "late": []}, "process-start guard is not installed"),
        ({}, True, {"installed": True, "late": ["sglang.srt.utils.common"]}, "ran after sglang.srt.utils.common"),
    ],
)
def test_selection_problems_are_one_line(env: dict[str, str], gpu: bool, guard: dict | None, needle: str) -> None:
    problem = platform_entry.selection_problem(env, lambda: gpu, guard)
    assert problem is not None and needle in problem and "\n" not in problem
    assert problem.startswith("kllm_cuda platform: ")


def test_no_problem_when_gpu_and_guard_are_in_place() -> None:
    assert platform_entry.selection_problem({"SGLANG_USE_CPU_ENGINE": "0"}, lambda: True, GOOD_GUARD) is None


def test_selected_without_a_gpu_stops_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLATFORM", "kllm_cuda")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(platform_entry, "_cuda_visible", lambda: False)
    with pytest.raises(SystemExit) as exc:
        platform_entry.activate()
    assert "no CUDA GPU visible" in str(exc.value.code) and "\n" not in str(exc.value.code)


def test_selected_with_gpu_and_guard_names_the_platform_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLATFORM", "kllm_cuda")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setattr(platform_entry, "_cuda_visible", lambda: True)
    monkeypatch.setattr(platform_entry, "_guard_state", lambda: GOOD_GUARD)
    assert platform_entry.activate() == platform_entry.PLATFORM_CLASS


def test_tree_core_follows_the_torch_sglang_was_built_for() -> None:
    g = load_guard()
    env_key = g.TREE_CORE_ENV
    assert g.pinned_torch(["numpy>=1", "torch==2.14.1", "triton"]) == "2.14.1"
    assert g.pinned_torch(["torch>=2.0"]) is None and g.pinned_torch(None) is None
    # another major.minor: the Python TreeCore, with the reason
    backend, reason = g.choose_tree_core({}, "2.11.0+cu130", "2.14.1")
    assert backend == "python" and "2.11.0+cu130" in reason and "2.14.1" in reason
    # the same major.minor (any patch or local tag): SGLang's own choice (the Rust one)
    assert g.choose_tree_core({}, "2.14.0+cu130", "2.14.1")[0] is None
    # the user's choice always wins; no pin: leave SGLang's choice
    assert g.choose_tree_core({env_key: "rust"}, "2.11.0", "2.14.1") == (None, f"{env_key}=rust set by the user")
    assert g.choose_tree_core({}, "2.11.0", None)[0] is None


def test_own_distribution_is_kept_and_others_still_excluded() -> None:
    g = load_guard()
    kept = g.keep_own_distribution(lambda: {"kllm_plugins", "vendor-npu-platform"})
    assert kept() == {"vendor-npu-platform"}
    assert kept._kllm_guard is True and kept.__wrapped__() == {"kllm_plugins", "vendor-npu-platform"}


_LOG_LINE = r"""
import sys
sys.path.insert(0, {guard_dir!r})
import torch
torch.cuda.get_device_name = lambda index=0: "NVIDIA Simulated"  # the only simulated part: no GPU here
import kllm_cuda_guard
kllm_cuda_guard.state["tree_core"] = ("python", "torch 2.11 is not 2.14.1")
from kllm_plugins.hardware.cuda.sglang_platform import KllmCudaPlatform
KllmCudaPlatform()
"""


@pytest.mark.sglang
@pytest.mark.slow
def test_platform_logs_its_line_before_anything_configured_logging() -> None:
    """SGLang builds its platform while importing its modules, before it (or our host) sets up
    logging: the line the GPU suite checks in every process must still be written."""
    code = _LOG_LINE.format(guard_dir=str(GUARD_FILE.parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "KLLM_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "kllm_cuda platform (pid" in ln]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "NVIDIA Simulated" in lines[0] and "TreeCore python (torch 2.11 is not 2.14.1)" in lines[0]
    assert "CUDA graphs off" in lines[0]
