"""The host applies the selected platform's patch list (hardware/<platform>/patches.py) and
verifies it like a plugin's; the ledger lists every platform's patches."""
from __future__ import annotations

import sys
from pathlib import Path
import types
from typing import Iterator

import pytest

from kllm_plugins import platform_patches, sglang_bridge
from kllm_plugins.attach import Attacher
from kllm_plugins.cli import patches_markdown
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.spec import PatchSpec

sys.path.insert(0, str(Path(__file__).parent))
from host_fixtures import WrappingRegistry  # noqa: E402


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"SGLANG_PLATFORM": "kllm_cpu"}, ["platform:kllm_cpu"]),
        ({"KLLM_DEVICE": "cpu"}, ["platform:kllm_cpu"]),
        ({}, []),
        ({"SGLANG_PLATFORM": "cuda"}, []),
        ({"SGLANG_PLATFORM": "kllm_cpu", "KLLM_PLATFORM_PATCHES": "0"}, []),
    ],
)
def test_cpu_platform_list_is_selected_by_the_environment(env: dict[str, str], expected: list[str]) -> None:
    assert [g for g, _ in platform_patches.selected_platform_groups(env)] == expected


def test_cpu_platform_list_holds_the_hicache_compat_patches() -> None:
    patches = dict(platform_patches.all_platform_groups())["platform:kllm_cpu"]
    targets = {p.target: p.impl for p in patches}
    assert targets["sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__"].endswith("hicache_compat:unpin_host_pool")
    assert targets["sglang.srt.mem_cache.pool_host.mha"].endswith("hicache_compat:bind_direct_copy")
    assert all(p.why.strip() for p in patches)


def test_ledger_lists_platform_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KLLM_EXTRA_PLUGINS", raising=False)
    ledger = patches_markdown(KllmPluginManager())
    assert "| platform:kllm_cpu | `sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__` | before |" in ledger
    assert "| platform:kllm_cpu | `sglang.srt.mem_cache.pool_host.mha` | registry |" in ledger


@pytest.fixture
def fake_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    mod = types.ModuleType("kllm_fake_platform")

    class Pool:
        def size(self) -> int:
            return 1

    mod.Pool = Pool  # type: ignore[attr-defined]
    mod.triple = lambda original, self: 3 * original(self)  # type: ignore[attr-defined]
    mod.selected = lambda env: env.get("FAKE_PLATFORM") == "1"  # type: ignore[attr-defined]
    mod.PATCHES = (PatchSpec("kllm_fake_platform.Pool.size", "kllm_fake_platform:triple", "around", "test"),)  # type: ignore[attr-defined]
    mod.BROKEN = (PatchSpec("kllm_fake_platform.Pool.missing", "kllm_fake_platform:triple", "around", "test"),)  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    monkeypatch.setattr(sglang_bridge, "HOST_PATCHES", ())
    monkeypatch.setattr(platform_patches, "PLATFORM_PATCH_LISTS",
                        {"fake": ("kllm_fake_platform:PATCHES", "kllm_fake_platform:selected")})
    yield mod
    del sys.modules[mod.__name__]


def _host() -> sglang_bridge.Host:
    h = sglang_bridge.Host(KllmPluginManager())
    h.attacher = Attacher(WrappingRegistry())
    return h


def test_host_applies_and_verifies_the_selected_platform_list(fake_platform: types.ModuleType,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PLATFORM", "1")
    h = _host()
    h.attach_host_patches()
    results = [r for rep in h.reports for r in rep.results]
    assert [(r.plugin, r.target, r.ok) for r in results] == [("platform:fake", "kllm_fake_platform.Pool.size", True)]
    assert fake_platform.Pool().size() == 3


def test_host_leaves_an_unselected_platform_alone(fake_platform: types.ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKE_PLATFORM", raising=False)
    h = _host()
    h.attach_host_patches()
    assert [r for rep in h.reports for r in rep.results] == []
    assert fake_platform.Pool().size() == 1


def test_a_platform_patch_that_fails_stops_a_strict_process(fake_platform: types.ModuleType,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PLATFORM", "1")
    monkeypatch.setenv("KLLM_STRICT", "1")
    monkeypatch.setattr(fake_platform, "PATCHES", fake_platform.BROKEN)
    with pytest.raises(SystemExit, match="platform:fake"):
        _host().attach_host_patches()
