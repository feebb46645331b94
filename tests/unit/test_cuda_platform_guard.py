"""The `kllm-plugins-cuda` distribution's process-start guard, installed for real (pip, into a
folder read as a site dir, so its .pth file runs as it does at interpreter start): with
`SGLANG_PLATFORM=kllm_cuda` SGLang's `is_cuda()` is False from its first import, the plugins of
`kllm-plugins` are kept, a missing sgl_kernel is refused with a clear error, an installed one is
left alone, and SGLang's own platform loader stops a GPU-less machine with one line. Without the
selection nothing changes. CPU only; each case is one fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "hardware" / "cuda" / "distribution"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("cuda-dist") / "site"
    build = tmp_path_factory.mktemp("cuda-build")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-compile", "-q",
         "--target", str(target), str(DIST)],
        capture_output=True, text=True, timeout=300, cwd=build,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for leftover in ("build", "kllm_plugins_cuda.egg-info"):  # setuptools may build in the source folder
        path = DIST / leftover
        if path.exists():
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    assert (target / "kllm_plugins_cuda.pth").is_file() and (target / "kllm_cuda_guard.py").is_file()
    return target


def run_python(site: Path, code: str, env_extra: dict[str, str], pythonpath: Path | None = None
               ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "KLLM_"))}
    env.update(env_extra)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    # site.addsitedir processes the folder's .pth files as the interpreter does for site-packages
    prelude = f"import site; site.addsitedir({str(site)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=site.parent)


FACTS = r"""
import json, sys
facts = {"guard_loaded": "kllm_cuda_guard" in sys.modules}
# SGLang resolves its platform while importing: simulate a visible GPU (none here), nothing else
import torch
torch.cuda.get_device_name = lambda index=0: "NVIDIA Simulated"
from kllm_plugins.hardware.cuda import platform_entry
platform_entry._cuda_visible = lambda: True
import sglang.srt.utils as utils
from sglang.srt.utils import common
facts["is_cuda"] = common.is_cuda()
facts["reexport_same"] = utils.is_cuda is common.is_cuda
facts["is_cuda_module"] = getattr(common.is_cuda, "__module__", "")
from sglang.srt import plugins
facts["excluded"] = sorted(plugins._get_excluded_dists())
facts["marked"] = bool(getattr(plugins._get_excluded_dists, "_kllm_guard", False))
try:
    import sgl_kernel
    facts["sgl_kernel"] = getattr(sgl_kernel, "VALUE", "imported")
except ModuleNotFoundError as exc:
    facts["sgl_kernel"] = "missing: " + str(exc)
facts["activate_unselected"] = platform_entry.activate() if not platform_entry.selected() else "selected"
if facts["guard_loaded"]:
    from kllm_plugins.hardware.cuda import process_checks
    facts["checks"] = [process_checks.check_is_cuda_guarded()(), process_checks.check_plugins_kept()(),
                       process_checks.check_tree_core_choice()()]
print("FACTS " + json.dumps(facts))
"""


def facts_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    return json.loads(line[len("FACTS "):])


def test_selected_guard_makes_is_cuda_false_and_keeps_the_plugins(site_dir: Path) -> None:
    facts = facts_of(run_python(site_dir, FACTS, {"SGLANG_PLATFORM": "kllm_cuda"}))
    assert facts["guard_loaded"] is True
    assert facts["is_cuda"] is False and facts["reexport_same"] and facts["is_cuda_module"] == "kllm_cuda_guard"
    # kllm-plugins ships kllm_cpu: SGLang would skip its general plugins; the guard keeps them
    assert facts["marked"] and not any(d.replace("_", "-").lower() == "kllm-plugins" for d in facts["excluded"])
    assert facts["sgl_kernel"].startswith("missing: kllm_cuda: sgl_kernel is not installed")
    assert facts["checks"] == [True, True, True]


def test_an_installed_sgl_kernel_is_left_alone(site_dir: Path, tmp_path: Path) -> None:
    pkg = tmp_path / "fake" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 'the installed one'\n")
    facts = facts_of(run_python(site_dir, FACTS, {"SGLANG_PLATFORM": "kllm_cuda"}, pythonpath=pkg.parent))
    assert facts["sgl_kernel"] == "the installed one"


def test_unselected_nothing_changes(site_dir: Path, tmp_path: Path) -> None:
    pkg = tmp_path / "fake" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 'the installed one'\n")
    facts = facts_of(run_python(site_dir, FACTS, {}, pythonpath=pkg.parent))
    assert facts["guard_loaded"] is False and facts["marked"] is False
    assert facts["is_cuda_module"] == "sglang.srt.utils.common"
    assert facts["sgl_kernel"] == "the installed one" and facts["activate_unselected"] is None


def test_sglang_platform_loader_stops_a_gpu_less_machine_with_one_line(site_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    code = "from sglang.srt.platforms import current_platform\nprint(current_platform.device_name)\n"
    proc = run_python(site_dir, code, {"SGLANG_PLATFORM": "kllm_cuda"})
    assert proc.returncode == 1, (proc.stdout[-1000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("kllm_cuda platform: no CUDA GPU visible to torch")


TREE_CORE = r"""
import os
import torch
torch.__version__ = "2.11.0+cu130"  # the GPU image's torch, not the 2.14.1 SGLang pins (simulated)
torch.cuda.get_device_name = lambda index=0: "NVIDIA Simulated"
from kllm_plugins.hardware.cuda import platform_entry
platform_entry._cuda_visible = lambda: True
import sglang.srt.utils.common  # resolves SGLang's platform while it runs (its module-level import)
print("ENV " + os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "unset"))
"""


def test_platform_line_names_the_tree_core_chosen_for_the_machines_torch(site_dir: Path) -> None:
    """SGLang builds the platform inside `sglang.srt.utils.common`'s own import, before the guard's
    after-import step: the TreeCore must already be decided when the platform logs it."""
    proc = run_python(site_dir, TREE_CORE, {"SGLANG_PLATFORM": "kllm_cuda"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ENV python" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "kllm_cuda platform (pid" in ln]
    assert len(lines) == 1 and "NVIDIA Simulated" in lines[0], proc.stderr[-3000:]
    assert "TreeCore python (torch 2.11.0+cu130 is not the 2.14.1" in lines[0], lines[0]
