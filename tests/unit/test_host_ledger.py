"""docs/PATCHES.md is the one place listing every SGLang target we patch; keep it generated."""
from __future__ import annotations

from pathlib import Path

from kllm_plugins.cli import patches_markdown
from kllm_plugins.manager import KllmPluginManager

ROOT = Path(__file__).resolve().parents[2]


def test_patch_ledger_is_current(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KLLM_EXTRA_PLUGINS", raising=False)
    expected = patches_markdown(KllmPluginManager())
    current = (ROOT / "docs" / "PATCHES.md").read_text()
    assert current == expected, "docs/PATCHES.md is stale: run `kllm-plugins patches > docs/PATCHES.md`"


def test_every_patch_says_why() -> None:
    manager = KllmPluginManager()
    for name in manager.names():
        for patch in manager.specs[name].patches:
            assert patch.why.strip(), f"{name}: {patch.target} has no reason"
