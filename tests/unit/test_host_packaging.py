"""The wheel: one namespaced import package, entry points, and it works when installed as a wheel."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (whl,) = out.glob("kllm_plugins-*.whl")
    return whl


def test_wheel_has_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kllm_plugins", next(t for t in tops if t.endswith(".dist-info"))}
    assert "kllm_plugins/plugins/trace/hookimpls.py" in names
    assert "kllm_plugins/hardware/cpu/sglang_platform.py" in names
    assert "kllm_plugins/py.typed" in names
    eps = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[sglang.srt.plugins]" in eps and "kllm = kllm_plugins.sglang_bridge:register" in eps
    assert "[sglang.srt.platforms]" in eps and "kllm_cpu = kllm_plugins.hardware.cpu.platform_entry:activate" in eps
    assert "[kllm_plugins]" in eps and "trace = kllm_plugins.plugins.trace.hookimpls" in eps


def test_wheel_install_imports_and_lists_plugins(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = (
        "import kllm_plugins, importlib.metadata as md\n"
        "assert kllm_plugins.__file__.startswith(%r), kllm_plugins.__file__\n"
        "from kllm_plugins.manager import KllmPluginManager\n"
        "print(sorted(KllmPluginManager().names()))\n"
    ) % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'trace'" in out.stdout
