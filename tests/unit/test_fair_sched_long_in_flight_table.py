"""The long-prompt-in-flight tables of docs/fair_sched.md, built from recorded summaries."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


def _summary(m: ModuleType) -> dict[str, Any]:
    runs = []
    for seed, scale in ((0, 1.0), (1, 1.5)):
        for name, short in (("fcfs", 4.0), ("fair_sched", 1.0), ("fair_sched/mp2", 1.2)):
            runs.append({"setup": name, "seed": seed, "short_n": 5.0, "medium_before_long": 1.0 if "mp2" in name else 0.0,
                         **dict.fromkeys(m.METRICS, 2.0), "short_mean": short * scale, "same_as_fcfs": True})
    runs.append({"setup": "hrrn", "seed": 0, "error": "server exited"})
    return {"metrics": m.summarize(runs, ["fcfs", "hrrn", "fair_sched", "fair_sched/mp2"]), "runs": runs,
            "settings": {"mediums": 3}, "setups": {"fair_sched/mp2": {"env": {"KLLM_FAIR_SCHED_MAX_PARTIAL_PREFILLS": "2"}}}}


def test_table_gives_fcfs_in_seconds_the_rest_as_ratios_and_names_failed_setups(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    t = bench_module("fair_sched", "long_in_flight_table")
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ") for r in t.table(_summary(m)).splitlines()[2:]}
    assert rows["fcfs"][2] == "5.00 s [4.00-6.00]"  # median of 4.0 and 6.0 with the spread
    assert rows["fair_sched"][2] == "0.25x"  # 1.25 / 5.0, both seeds 0.25: no spread shown
    assert rows["fair_sched/mp2 (max_partial_prefills=2)"][-2:] == ["1 of 3", "yes |"]
    assert rows["hrrn"][1:3] == ["0 of 1", "server exited"]


def test_render_fills_both_blocks_and_lists_each_gpu_file(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    m = bench_module("fair_sched", "long_in_flight")
    t = bench_module("fair_sched", "long_in_flight_table")
    s = _summary(m)
    (tmp_path / "long_in_flight.json").write_text(json.dumps(s))
    gpu = {**s, "machine": {"gpu": "NVIDIA H100 80GB HBM3"}, "model": "m", "commit": "abc",
           "settings": {"mediums": 3, "long_tokens": 100000, "chunk": 8192, "seeds": 2, "shorts": 24,
                        "short_len": [256, 4096], "rate": 2.0, "medium_len": [8000, 20000]}}
    (tmp_path / "long_in_flight_gpu_x.json").write_text(json.dumps(gpu))
    doc = "a\n<!-- generated:long-in-flight-cpu -->\nold\n<!-- /generated:long-in-flight-cpu -->\n" \
          "<!-- generated:long-in-flight-gpu -->\n<!-- /generated:long-in-flight-gpu -->\n"
    out = t.render(doc, tmp_path)
    assert "old" not in out and out.count("| fcfs | 2 |") == 2
    assert "`long_in_flight_gpu_x.json`: H100 80GB HBM3, m, 100,000-token prompt, chunk 8192" in out


def test_the_docs_tables_are_those_the_recorded_summaries_give(bench_module: Callable[[str, str], ModuleType]) -> None:
    t = bench_module("fair_sched", "long_in_flight_table")
    text = t.DOC.read_text(encoding="utf-8")
    assert t.render(text) == text, "run python benchmarks/fair_sched/long_in_flight_table.py --write"
