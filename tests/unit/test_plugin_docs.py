"""Each plugin page's generated sections (options, ledger) match its PluginSpec."""
from __future__ import annotations

from pathlib import Path

from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.plugin_docs import render_page, stale_pages
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec

ROOT = Path(__file__).resolve().parents[2]

SPEC = PluginSpec(
    name="demo_plug",
    summary="demo",
    status="experimental",
    options=(OptionSpec("depth", int, 3, "how deep | far"),),
    patches=(PatchSpec("sglang.srt.x.Y.f", "kllm_plugins.x:f", "around", "needs it", "a hook upstream"),),
)
PAGE = (
    "# demo\n\n## Options\n\n<!-- generated:options -->\nold\n<!-- /generated:options -->\n\n"
    "## How it attaches\n\n<!-- generated:ledger -->\n<!-- /generated:ledger -->\n\nkept\n"
)


def test_plugin_pages_are_current(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KLLM_EXTRA_PLUGINS", raising=False)
    manager = KllmPluginManager()
    specs = {name: manager.specs[name] for name in manager.names()}
    stale = stale_pages(ROOT / "docs", specs)
    assert not stale, f"generated sections of docs/{{{','.join(stale)}}}.md are stale: run `kllm-plugins docs`"


def test_render_fills_both_sections_and_keeps_the_rest() -> None:
    out = render_page(PAGE, SPEC)
    assert "old" not in out
    assert "| `--kllm-demo-plug-depth` | `KLLM_DEMO_PLUG_DEPTH` | int | `3` | how deep \\| far |" in out
    assert "| `sglang.srt.x.Y.f` | around | needs it | a hook upstream |" in out
    assert out.endswith("kept\n")
    assert render_page(out, SPEC) == out


def test_a_stale_page_is_found_and_a_page_without_markers_is_not(tmp_path: Path) -> None:
    (tmp_path / "demo_plug.md").write_text(PAGE)
    assert stale_pages(tmp_path, {"demo_plug": SPEC}) == ["demo_plug"]
    (tmp_path / "demo_plug.md").write_text(render_page(PAGE, SPEC))
    assert stale_pages(tmp_path, {"demo_plug": SPEC}) == []
    (tmp_path / "demo_plug.md").write_text("# no markers\n")
    assert stale_pages(tmp_path, {"demo_plug": SPEC}) == []
