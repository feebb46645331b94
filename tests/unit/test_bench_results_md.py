"""benchmarks/RESULTS.md is generated from benchmarks/results/<plugin>/<name>.json; keep it current."""
import json
from pathlib import Path

import pytest

from kllm_plugins.bench import record, results_md

ROOT = Path(__file__).resolve().parents[2]


def test_results_md_is_current():
    assert results_md.is_current(ROOT), "benchmarks/RESULTS.md is stale: run `kllm-plugins results --write`"


def test_results_in_git_are_small_and_laid_out():
    base = record.results_dir(ROOT)
    files = [p for p in base.rglob("*") if p.is_file() and p.name != "README.md"]
    assert not [p.name for p in base.glob("*.json")], "result files belong under benchmarks/results/<plugin>/"
    assert all(p.stat().st_size <= record.MAX_BYTES for p in files if p.suffix == ".json")


def test_record_writes_a_summary_the_generator_renders(tmp_path):
    path = record.record("kv_tiers", "demo", "python bench.py --x 1",
                         {"ttft_s": {"median": 0.123456789, "min": 0.1, "max": 0.2, "repeats": [0.1, 0.2]},
                          "throughput_vs_stock": {"ratio": 1.5, "min": 1.25, "max": 1.75}},
                         root=tmp_path, machine="test box", commit="abc1234", date="2026-01-01T00:00:00Z")
    data = json.loads(path.read_text())
    assert path == tmp_path / "benchmarks" / "results" / "kv_tiers" / "demo.json"
    assert data["metrics"]["ttft_s"]["median"] == 0.123457
    text = results_md.render(tmp_path)
    assert "[demo](results/kv_tiers/demo.json)" in text
    assert "ttft_s: 0.1235 [0.1-0.2]" in text and "throughput_vs_stock: 1.5x [1.25-1.75]" in text
    assert "`python bench.py --x 1`" in text
    assert not results_md.is_current(tmp_path)
    results_md.write(tmp_path)
    assert results_md.is_current(tmp_path)


def test_bad_summaries_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown plugin"):
        record.result_path("nope", "x", tmp_path)
    with pytest.raises(ValueError, match="lacks commit"):
        record.write_summary(tmp_path / "a.json", {"command": "c", "machine": "m", "date": "d", "metrics": {}})
    with pytest.raises(ValueError, match="keep per-request data out"):
        record.write_summary(tmp_path / "b.json", {"command": "c", "commit": "x", "machine": "m", "date": "d",
                                                   "metrics": {"raw": list(range(40000))}})
    folder = tmp_path / "benchmarks" / "results" / "trace"
    folder.mkdir(parents=True)
    (folder / "x.json").write_text(json.dumps({"command": "c"}))
    with pytest.raises(ValueError, match="x.json: result summary lacks commit"):
        results_md.render(tmp_path)


def test_machine_line_names_the_cpu_and_whether_it_has_bf16() -> None:
    info = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2\n"
    assert record.cpu_model(info) == "AMD EPYC 7B13, bf16 emulated"
    assert record.cpu_model(info.replace("avx2", "avx2 amx_bf16")) == "AMD EPYC 7B13, bf16 native"
    assert record.cpu_model("processor\t: 0\n") == ""
    assert "-core" in record.machine_description("shared")
