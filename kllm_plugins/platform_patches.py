"""Layer: host core (no SGLang import). The patch lists of hardware platforms.

Some SGLang patches belong to a platform, not to a capability: the `kllm_cpu` platform needs
HiCache's host pools unpinned and torch versions of its direct I/O ops, whichever plugins are
on; the `kllm_cuda` platform's list checks what its process-start guard did. Each platform of
ours may name a patch list here; the host applies the selected platform's list in every SGLang
process, before any plugin's, and verifies it target by target like a
plugin's (`KLLM_STRICT=1` stops the process on a failure). The ledger (`kllm-plugins patches`,
docs/PATCHES.md) and `kllm-plugins doctor` list them as `platform:<name>`. `KLLM_PLATFORM_PATCHES=0`
applies none.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

from kllm_plugins.attach import resolve_impl
from kllm_plugins.spec import PatchSpec

#: set to 0 to apply no platform patch list (e.g. to compare against SGLang without them)
ENV_SWITCH = "KLLM_PLATFORM_PATCHES"

#: platform name -> ("module:attr" of its patch tuple, "module:attr" of its selection check)
PLATFORM_PATCH_LISTS: dict[str, tuple[str, str]] = {
    "kllm_cpu": (
        "kllm_plugins.hardware.cpu.patches:PATCHES",
        "kllm_plugins.hardware.cpu.platform_entry:selected",
    ),
    "kllm_cuda": (
        "kllm_plugins.hardware.cuda.patches:PATCHES",
        "kllm_plugins.hardware.cuda.platform_entry:selected",
    ),
}


def group_name(platform: str) -> str:
    return f"platform:{platform}"


def platform_patches(platform: str) -> tuple[PatchSpec, ...]:
    """The patch list of one platform (KeyError for an unknown name)."""
    patches = resolve_impl(PLATFORM_PATCH_LISTS[platform][0])
    return tuple(patches)


def all_platform_groups() -> list[tuple[str, tuple[PatchSpec, ...]]]:
    """(`platform:<name>`, patches) for every platform with a list, selected or not: the ledger."""
    return [(group_name(name), platform_patches(name)) for name in sorted(PLATFORM_PATCH_LISTS)]


def selected_platform_groups(env: Mapping[str, str] | None = None) -> list[tuple[str, tuple[PatchSpec, ...]]]:
    """The groups of the platforms the environment selects (what the host applies)."""
    env = os.environ if env is None else env
    if env.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    groups = []
    for name in sorted(PLATFORM_PATCH_LISTS):
        is_selected: Callable[[Mapping[str, str]], bool] = resolve_impl(PLATFORM_PATCH_LISTS[name][1])
        if is_selected(env):
            groups.append((group_name(name), platform_patches(name)))
    return groups
