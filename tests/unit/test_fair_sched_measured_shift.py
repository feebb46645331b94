"""The measured latency shift: the model's accounting applied to recorded GPU and CPU-server runs."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest


@pytest.fixture
def ms(bench_module: Callable[[str, str], ModuleType]) -> ModuleType:
    return bench_module("fair_sched", "measured_shift")


def _fig(ttft: float, decode: float, tpot: float = 0.01, p99: float = 3.0) -> dict[str, dict[str, float]]:
    return {"ttft_s_mean": {"mean": ttft}, "e2e_s_mean": {"mean": ttft + decode}, "decode_s_mean": {"mean": decode},
            "tpot_s_mean": {"mean": tpot}, "ttft_s_p99": {"mean": p99}}


def test_doc_table_is_current(ms: ModuleType) -> None:
    text = ms.DOC.read_text(encoding="utf-8")
    assert ms.render(text) == text, "run: python benchmarks/fair_sched/measured_shift.py --write"


def test_a_gpu_cell_is_accounted_against_the_stock_servers_that_stayed_up(ms: ModuleType, tmp_path: Path) -> None:
    """fcfs 1.0 s TTFT / 1.0 s decode; hrrn saves 0.2 s; shortest-prefill-first would save more but
    its server exited, so the needed saving is hrrn's (0.2 s) and the shift allowed 0.3 / 0.2;
    fair_sched saves 0.5 s and adds 0.4 s of decode (shift 0.8). A file recorded before decode time
    was measured adds no row."""
    cell = {"fcfs": _fig(1.0, 1.0), "lpm": _fig(1.0, 1.0), "hrrn": _fig(0.8, 1.1),
            "shortest-prefill-first": _fig(0.3, 1.6), "fair_sched": _fig(0.5, 1.4), "fair_sched/x9": _fig(0.6, 1.2),
            "exited": ["shortest-prefill-first"]}
    h100 = {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "settings": {"layers": 8}}
    (tmp_path / "gpu_a.json").write_text(json.dumps({**h100, "metrics": {"issue@2048@0.6": cell}}))
    old = {"fcfs": {"ttft_s_mean": {"mean": 1.0}}, "fair_sched": {"ttft_s_mean": {"mean": 0.5}}}
    (tmp_path / "gpu_b.json").write_text(json.dumps({**h100, "metrics": {"issue@2048@0.85": old}}))
    [(where, key, c)] = ms.measured(tmp_path)
    assert (where, key, c["file"]) == ("H100, 8 layers", "issue@2048@0.6", "gpu_a.json")
    assert "shortest-prefill-first" not in c["policies"]
    assert c["budget"]["needed_saving_s"] == pytest.approx(0.2)
    assert c["budget"]["shift_allowed"] == pytest.approx(0.3 / 0.2)
    fs = c["policies"]["fair_sched"]
    assert fs["shift"] == pytest.approx(0.4 / 0.5) and fs["e2e_vs_fcfs"] == pytest.approx(0.95)
    text = ms.table(tmp_path, model={})
    assert text.count("| H100, 8 layers | issue @ 2048 @ 0.6 |") == 1 and "| 0.80 (0.50 / 0.95 / 1.00) |" in text
    assert "| x9 0.50 (0.60 / 0.90 / 1.00) |" in text  # another setting, beside


def test_a_cpu_grid_load_with_decode_time_is_a_row(ms: ModuleType, tmp_path: Path) -> None:
    def m(ttft: float, decode: float) -> dict[str, float]:
        return {"mean": ttft, "e2e": ttft + decode, "decode": decode, "tpot": 0.03, "p99": 2.0}

    cells = {"0.6": {"seed_mean": {"fcfs": m(0.4, 1.0), "shortest-prefill-first": m(0.2, 1.5), "fair_sched": m(0.1, 1.1)}},
             "0.85": {"seed_mean": {"fcfs": {"mean": 0.5, "p99": 2.0}}}}
    (tmp_path / "cpu_shift_x_128.json").write_text(json.dumps({"trace": "x", "chunk": 128, "metrics": {"cells": cells}}))
    [(where, key, c)] = ms.measured(tmp_path)
    assert (where, key) == ("CPU", "x@128@0.6")
    assert c["policies"]["shortest-prefill-first"]["shift"] == pytest.approx(0.5 / 0.2)
    assert c["policies"]["fair_sched"]["shift"] == pytest.approx(0.1 / 0.3)


def test_the_model_stands_beside_only_the_card_it_is_costed_for(ms: ModuleType, tmp_path: Path) -> None:
    cell = {"fcfs": _fig(1.0, 1.0), "hrrn": _fig(0.8, 1.1), "fair_sched": _fig(0.5, 1.4)}
    for name, gpu, layers in (("gpu_a.json", "NVIDIA H100 80GB HBM3", 8), ("gpu_b.json", "NVIDIA H200", 32)):
        (tmp_path / name).write_text(json.dumps({"machine": {"gpu": gpu}, "settings": {"layers": layers},
                                                 "metrics": {"issue@2048@0.6": cell}}))
    sim = {"budget": {"shift_allowed": 0.33}, "policies": {p: {"shift": 0.9} for p in ms.SHOWN}}
    rows = [r for r in ms.table(tmp_path, model={"issue@2048@0.6": sim}).splitlines() if "issue @ 2048" in r]
    assert [r.split(" | ")[0] for r in rows] == ["| H100, 8 layers", "| H200"]
    assert "| 0.33; 0.90 / 0.90 / 0.90 |" in rows[0] and "0.33;" not in rows[1]
