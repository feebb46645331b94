"""bench_tiers builds every setup's servers in one place (setup_servers): `--dtype` reaches them all."""
from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any, Callable

import pytest


def test_dtype_reaches_every_server_of_a_setup(bench_module: Callable[[str, str], ModuleType],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bt = bench_module("kv_tiers", "bench_tiers")
    seen: list[list[str]] = []

    def factory(plugins: list[str], extra: list[str], env: dict[str, str], l1: int, tag: str) -> Any:
        seen.append(extra)
        return tag

    monkeypatch.setattr(bt, "SERVER_FACTORY", factory)
    bt.setup_servers("l1_only", "/tmp/store", argparse.Namespace(dtype="float32", medium=None), "", 3072, 1)
    assert seen == [["--dtype", "float32"]] * 2
    seen.clear()
    bt.setup_servers("l1_only", "/tmp/store", None, "", 3072, 1, count=1)  # other drivers: the model's own dtype
    assert seen == [[]]
