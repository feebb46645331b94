"""Layer: hardware, CUDA platform; process start (imports neither torch nor SGLang, nor kllm_plugins).

The `kllm_cuda` platform runs SGLang on NVIDIA GPUs without sgl-kernel. SGLang's
`sglang.srt.utils.common.is_cuda()` reads torch directly (it ignores the selected platform) and
guards module-level `from sgl_kernel import ...` statements in dozens of modules, all of which run
when a process imports SGLang, before any plugin or platform code. SGLang spawns its scheduler and
detokenizer, so this has to happen at the start of every Python process: the distribution
`kllm-plugins-cuda` installs `kllm_plugins_cuda.pth`, whose one line calls `install()` when, and
only when, `SGLANG_PLATFORM=kllm_cuda`. `install()` adds one import finder that:

1. right after `sglang.srt.utils.common` has run, replaces its `is_cuda` by a function that returns
   False (before any other SGLang module has read it), and picks the TreeCore the machine's torch
   can run: SGLang's bundled Rust TreeCore is compiled against the torch SGLang pins; on another
   torch (major.minor) it misreads tensor dtypes, so `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`
   is set unless the user chose one;
2. right after `sglang.srt.plugins` has run, keeps the `kllm-plugins` distribution's general plugin
   from being skipped: SGLang skips the general plugins of every distribution that ships a platform
   other than the selected one, and `kllm-plugins` ships `kllm_cpu` (inert unless selected);
3. answers an import of `sgl_kernel`, where none is installed, with an ImportError that says so,
   so a code path with no torch fallback fails with a clear message, never a stand-in.

Nothing else changes, and nothing at all unless the platform is selected. The platform's ledger
(`kllm_plugins/hardware/cuda/patches.py`) checks every one of these in every SGLang process.
"""
from __future__ import annotations

import functools
import importlib.abc
import os
import re
import sys
from typing import Any, Callable, Mapping

PLATFORM = "kllm_cuda"
OWN_DISTRIBUTION = "kllm-plugins"
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
COMMON = "sglang.srt.utils.common"
LOADER = "sglang.srt.plugins"

#: what this process's guard did (read by the platform's ledger checks and its log line)
state: dict[str, Any] = {
    "installed": False,
    "late": [],          # modules already imported when install() ran (the guard came too late)
    "patched": [],       # modules post-processed so far
    "tree_core": None,   # (backend, reason) once decided
}


def selected(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("SGLANG_PLATFORM") == PLATFORM


@functools.lru_cache(maxsize=1)
def guarded_is_cuda() -> bool:
    """`sglang.srt.utils.common.is_cuda` on the kllm_cuda platform: False, so SGLang takes its
    torch-native and Triton paths instead of importing sgl-kernel."""
    return False


def normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def keep_own_distribution(get_excluded: Callable[[], set]) -> Callable[[], set]:
    def kllm_get_excluded_dists() -> set:
        return {d for d in get_excluded() if normalize(d) != OWN_DISTRIBUTION}

    kllm_get_excluded_dists.__wrapped__ = get_excluded  # type: ignore[attr-defined]
    kllm_get_excluded_dists._kllm_guard = True  # type: ignore[attr-defined]
    return kllm_get_excluded_dists


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def pinned_torch(requirements: list[str] | None) -> str | None:
    """The torch version SGLang's wheel pins (`torch==X`), which its Rust extensions are built for."""
    for req in requirements or []:
        m = re.match(r"^torch\s*==\s*([0-9][^;,\s]*)", req.strip())
        if m:
            return m.group(1)
    return None


def choose_tree_core(env: Mapping[str, str], torch_version: str, sglang_torch: str | None) -> tuple[str | None, str]:
    """(backend to set or None to leave SGLang's choice, reason)."""
    if env.get(TREE_CORE_ENV):
        return None, f"{TREE_CORE_ENV}={env[TREE_CORE_ENV]} set by the user"
    if sglang_torch is None:
        return None, "SGLang pins no torch version; SGLang's own TreeCore choice"
    if _major_minor(torch_version) == _major_minor(sglang_torch):
        return None, f"torch {torch_version} matches the {sglang_torch} SGLang's Rust TreeCore is built for"
    return "python", (f"torch {torch_version} is not the {sglang_torch} SGLang's bundled Rust TreeCore is built "
                      "for (it misreads tensor dtypes there): the Python TreeCore")


def _decide_tree_core() -> None:
    import importlib.metadata as md

    torch = sys.modules.get("torch")
    torch_version = str(getattr(torch, "__version__", "")) if torch is not None else md.version("torch")
    try:
        pin = pinned_torch(md.requires("sglang"))
    except md.PackageNotFoundError:
        pin = None
    backend, reason = choose_tree_core(os.environ, torch_version, pin)
    if backend is not None:
        os.environ[TREE_CORE_ENV] = backend
    state["tree_core"] = (os.environ.get(TREE_CORE_ENV, "rust"), reason)


def tree_core() -> tuple[str, str]:
    """(backend, reason), decided on first use: SGLang builds its platform (which logs this) while
    `sglang.srt.utils.common` is still running, before `_after_common`."""
    if state["tree_core"] is None:
        _decide_tree_core()
    return state["tree_core"]


def _after_common(module: Any) -> None:
    module.is_cuda = guarded_is_cuda
    tree_core()


def _after_loader(module: Any) -> None:
    module._get_excluded_dists = keep_own_distribution(module._get_excluded_dists)


POST_EXEC: dict[str, Callable[[Any], None]] = {COMMON: _after_common, LOADER: _after_loader}


class _PostExecLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self._inner, self._name = inner, name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        POST_EXEC[self._name](module)
        state["patched"].append(self._name)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._inner, attr)


class SglKernelMissing(ModuleNotFoundError):
    pass


class GuardFinder(importlib.abc.MetaPathFinder):
    """Post-processes the two SGLang modules above; refuses a missing sgl_kernel clearly."""

    def _next_spec(self, fullname: str, path: Any, target: Any) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in POST_EXEC:
            spec = self._next_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PostExecLoader(spec.loader, fullname)
            return spec
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            spec = self._next_spec(fullname, path, target)
            if spec is None:
                raise SglKernelMissing(
                    f"kllm_cuda: {fullname} is not installed; this code path needs sgl-kernel and has no "
                    "torch-native fallback on the kllm_cuda platform (choose another backend or feature, "
                    "or install sgl-kernel and use SGLang's own CUDA platform)",
                    name=fullname,
                )
            return spec
        return None


def install() -> bool:
    """Install the guard in this process (idempotent). Returns whether it is in place."""
    if state["installed"]:
        return True
    state["late"] = [m for m in POST_EXEC if m in sys.modules]
    sys.meta_path.insert(0, GuardFinder())
    state["installed"] = True
    return True
