"""The simulated comparison of one and two partial prefills: its docs table is the one built from
the recorded summary, and the table reads both settings of the same cells."""
from __future__ import annotations

import json
from types import ModuleType
from typing import Callable

from kllm_plugins.bench.record import result_path


def test_table_pairs_the_settings_cell_by_cell(bench_module: Callable[[str, str], ModuleType]) -> None:
    sm = bench_module("fair_sched", "sim_max_partial")
    cell = {k: 1.0 for k in sm.TARGETS}
    one = {"x@0.6": {**cell, "all_met": True}}
    two = {"x@0.6": {**cell, "mean <= best stock": 0.5, "p99 <= fcfs": 1.2, "all_met": False}}
    metrics = {f"{c}:{mp}": (one if mp == 1 else two) for _, _, c in sm.SCALES for mp in sm.SETTINGS}
    lines = sm.table({"metrics": metrics}).splitlines()
    row = lines[2].split(" | ")
    assert row[0] == "| 128" and row[1] == "x @ 0.6" and row[2] == "1.00 / 0.50" and row[4] == "1.00 / 1.20"
    assert row[-1] == "yes / no |"
    assert "chunk 128: 1 / 0 of 1" in lines[-1]


def test_doc_table_is_current(bench_module: Callable[[str, str], ModuleType]) -> None:
    sm = bench_module("fair_sched", "sim_max_partial")
    summary = json.loads(result_path("fair_sched", "sim_max_partial").read_text())
    assert set(summary["metrics"]) == {f"{c}:{mp}" for _, _, c in sm.SCALES for mp in sm.SETTINGS}
    text = sm.DOC.read_text(encoding="utf-8")
    assert sm.render(text, summary) == text, "run: python benchmarks/fair_sched/sim_max_partial.py --write-doc"
