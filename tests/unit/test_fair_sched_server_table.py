"""The real-server grid table of docs/fair_sched.md is the one built from the recorded summaries."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest


def test_doc_table_is_current(bench_module: Callable[[str, str], ModuleType]) -> None:
    st = bench_module("fair_sched", "server_table")
    text = st.DOC.read_text(encoding="utf-8")
    assert st.render(text) == text, "run: python benchmarks/fair_sched/server_table.py --write"


def test_rows_mark_missed_targets_and_name_the_best_stock_policy(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    st = bench_module("fair_sched", "server_table")
    means = {p: {"mean": m} for p, m in (("fcfs", 2.0), ("lpm", 3.0), ("shortest-prefill-first", 1.0),
                                         ("hrrn", 1.5), ("fair_sched", 0.9))}
    targets = {k: {"value": 1.1, "target": 1.0, "met": k != "p99 <= fcfs"} for k, _ in st.COLUMNS}
    cell = {"seed_mean": means, "targets": targets, "outputs_identical_to_fcfs": {"fair_sched": 1.0, "lpm": 0.99}}
    (tmp_path / "server_x_128.json").write_text(json.dumps(
        {"trace": "x", "chunk": 128, "seeds": 3, "date": "2026-12-05T00:56:47Z", "requests_per_run": 120,
         "metrics": {"cells": {"0.85": cell, "0.6": cell}}}))
    lines = st.table(tmp_path).splitlines()
    assert [ln.split(" | ")[2] for ln in lines[2:]] == ["0.6", "0.85"]  # loads in order
    row = lines[2].split(" | ")
    assert row[3] == "120" and row[5] == "2026-12-05"  # requests a run, the day it was recorded
    assert row[6] == "shortest-prefill-first" and row[9] == "1.10 *" and row[7] == "1.10"
    assert row[-1] == "yes (stock: lpm 99.0%) |"  # fair_sched's outputs equal fcfs's; lpm's differ on 1%
    (tmp_path / "server_x_128.json").write_text(json.dumps(
        {"trace": "x", "chunk": 128, "seeds": 3, "date": "2026-12-05T00:56:47Z", "requests_per_run": 120,
         "metrics": {"cells": {"0.85": cell}, "servers_exited": {"lpm": {"seed": 1}}}}))
    assert st.table(tmp_path).splitlines()[2].split(" | ")[6] == "shortest-prefill-first (lpm exited)"
    with pytest.raises(SystemExit, match="no <!-- generated:server-grid -->"):
        st.render("no markers here", tmp_path)


def test_a_disaggregated_grid_has_its_own_table(bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    st = bench_module("fair_sched", "server_table")
    means = {p: {"mean": 1.0} for p in ("fcfs", "shortest-prefill-first", "fair_sched")}
    targets = {k: {"value": 1.0, "target": 1.0, "met": True} for k, _ in st.COLUMNS}
    cell = {"seed_mean": means, "targets": targets, "outputs_identical_to_fcfs": {"fair_sched": 1.0}}
    for name, trace, pd in (("server_x_128.json", "x", None), ("server_pd_y_128.json", "y", {"threads_per_server": 1})):
        (tmp_path / name).write_text(json.dumps(
            {"trace": trace, "chunk": 128, "seeds": 2, "date": "2026-12-07", "requests_per_run": 120, "pd": pd,
             "metrics": {"cells": {"0.6": cell}}}))
    one, pd_rows = st.table(tmp_path).splitlines()[2:], st.table(tmp_path, pd=True).splitlines()[2:]
    assert [r.split(" | ")[0] for r in one] == ["| x"] and [r.split(" | ")[0] for r in pd_rows] == ["| y"]
