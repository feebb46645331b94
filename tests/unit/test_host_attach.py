"""Attachment verification with a registry double: each target is checked after apply."""
from __future__ import annotations

import sys
from pathlib import Path
import types
from typing import Any, Callable

import pytest

from kllm_plugins.attach import Attacher, import_prefix
from kllm_plugins.spec import PatchSpec

sys.path.insert(0, str(Path(__file__).parent))
from host_fixtures import WrappingRegistry  # noqa: E402


@pytest.fixture
def fake_module() -> types.ModuleType:
    mod = types.ModuleType("kllm_fake_target")

    class Engine:
        def step(self) -> int:
            return 1

    mod.Engine = Engine  # type: ignore[attr-defined]
    mod.double_step = lambda original, self: 2 * original(self)  # type: ignore[attr-defined]
    mod.registered = []  # type: ignore[attr-defined]

    def do_register() -> Callable[[], bool]:
        mod.registered.append("x")  # type: ignore[attr-defined]
        return lambda: "x" in mod.registered  # type: ignore[attr-defined]

    mod.do_register = do_register  # type: ignore[attr-defined]
    mod.bad_register = lambda: (lambda: False)  # type: ignore[attr-defined]
    sys.modules["kllm_fake_target"] = mod
    yield mod
    del sys.modules["kllm_fake_target"]


def test_applied_hook_is_verified_and_works(fake_module: types.ModuleType) -> None:
    attacher = Attacher(WrappingRegistry())
    attacher.add("p", [PatchSpec("kllm_fake_target.Engine.step", "kllm_fake_target:double_step", "around", "test")])
    report = attacher.apply_and_verify()
    assert [r.ok for r in report.results] == [True]
    assert fake_module.Engine().step() == 2


def test_hook_swallowed_by_registry_is_reported(fake_module: types.ModuleType) -> None:
    attacher = Attacher(WrappingRegistry(drop={"kllm_fake_target.Engine.step"}))
    attacher.add("p", [PatchSpec("kllm_fake_target.Engine.step", "kllm_fake_target:double_step", "around", "test")])
    report = attacher.apply_and_verify()
    assert not report.results[0].ok and "not wrapped" in report.results[0].reason
    assert report.summary() == "0/1 hooks attached"


def test_missing_target_and_missing_impl_are_reported(fake_module: types.ModuleType) -> None:
    attacher = Attacher(WrappingRegistry())
    attacher.add("p", [
        PatchSpec("kllm_fake_target.Engine.nope", "kllm_fake_target:double_step", "around", "test"),
        PatchSpec("kllm_fake_target.Engine.step", "kllm_fake_target:nope", "around", "test"),
    ])
    report = attacher.apply_and_verify()
    assert [r.ok for r in report.results] == [False, False]
    assert "nope" in report.results[0].reason and "nope" in report.results[1].reason


def test_registry_patch_uses_its_checker(fake_module: types.ModuleType) -> None:
    attacher = Attacher(WrappingRegistry())
    attacher.add("p", [
        PatchSpec("kllm_fake_target.Engine", "kllm_fake_target:do_register", "registry", "test"),
        PatchSpec("kllm_fake_target.Engine", "kllm_fake_target:bad_register", "registry", "test2"),
    ])
    # two patches of one plugin on one target (a BEFORE and an AFTER, say) are both attached and
    # checked; only the very same patch registered again is skipped (idempotent registration)
    attacher.add("p", [PatchSpec("kllm_fake_target.Engine", "kllm_fake_target:do_register", "registry", "test")])
    report = attacher.apply_and_verify()
    assert [r.ok for r in report.results] == [True, False]
    attacher2 = Attacher(WrappingRegistry())
    attacher2.add("q", [PatchSpec("kllm_fake_target.Engine", "kllm_fake_target:bad_register", "registry", "t")])
    assert attacher2.apply_and_verify().results[0].reason == "registry does not hold it"


def test_import_prefix_reports_inner_import_errors(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "kllm_brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import kllm_dependency_that_is_missing\nX = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="kllm_dependency_that_is_missing"):
        import_prefix("kllm_brokenpkg.mod.X")
    obj, rest = import_prefix("kllm_brokenpkg.Thing.attr")
    assert obj.__name__ == "kllm_brokenpkg" and rest == ["Thing", "attr"]


def test_patch_spec_validation() -> None:
    with pytest.raises(ValueError, match="dotted"):
        PatchSpec("nodots", "m:f", "around", "x")
    with pytest.raises(ValueError, match="module:attr"):
        PatchSpec("a.b", "m.f", "around", "x")
    with pytest.raises(ValueError, match="before/after"):
        PatchSpec("a.b", "m:f", "sideways", "x")  # type: ignore[arg-type]
