"""The CPU platform's patch list against the installed SGLang: every target and implementation
resolves, the host-pool hook unpins only where the platform has no pinned memory, and the direct
I/O ops are bound. (End to end, `test_incr_prefix_e2e.py[rust-hicache]` serves with HiCache on the
CPU platform and no kv_tiers plugin: only this list makes that work.)"""
from __future__ import annotations

import pytest

from kllm_plugins.attach import resolve_impl, resolve_target
from kllm_plugins.hardware.cpu import hicache_compat
from kllm_plugins.platform_patches import platform_patches

pytestmark = pytest.mark.sglang


def test_every_cpu_platform_patch_resolves() -> None:
    for patch in platform_patches("kllm_cpu"):
        resolve_target(patch.target)
        assert callable(resolve_impl(patch.impl)), patch.impl


def test_host_pool_hook_unpins_only_without_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_pin_memory_available", lambda self, device=None: False)
    assert hicache_compat.unpin_host_pool("self", pin_memory=True, page_size=16) == (
        ("self",), {"pin_memory": False, "page_size": 16})
    monkeypatch.setattr(type(current_platform), "is_pin_memory_available", lambda self, device=None: True)
    assert hicache_compat.unpin_host_pool("self", pin_memory=True) is None


def test_direct_ops_are_bound_and_checked() -> None:
    from sglang.srt.mem_cache.pool_host import mha

    check = hicache_compat.bind_direct_copy()
    assert check()
    assert all(callable(getattr(mha, name)) for name in hicache_compat.DIRECT_OPS)
