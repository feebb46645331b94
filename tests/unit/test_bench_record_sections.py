"""The recorder's combined summaries (`update_sections`): one file that several commands write,
each its own section, the rest kept."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kllm_plugins.bench.record import REQUIRED_KEYS, update_sections


def test_sections_of_other_commands_are_kept_and_each_command_is_listed(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    update_sections(path, "routing", "python a.py", {"routing": [{"policy": "rr", "hit": 0.5}]},
                    metrics={"hit": 0.5}, commit="c1", machine="m1", date="2026-01-01T00:00:00Z")
    update_sections(path, "scaling", "python b.py --x", {"scaling": {"att": 0.9}}, commit="c2", machine="m2",
                    date="2026-01-02T00:00:00Z")
    data = json.loads(path.read_text())
    assert set(REQUIRED_KEYS) <= set(data)
    assert data["routing"] == [{"policy": "rr", "hit": 0.5}] and data["scaling"] == {"att": 0.9}
    assert data["commands"] == {"routing": "python a.py", "scaling": "python b.py --x"}
    assert data["command"] == "python a.py && python b.py --x"
    assert data["metrics"] == {"routing": {"hit": 0.5}}  # scaling gave none
    assert data["provenance"]["routing"]["commit"] == "c1" and data["provenance"]["scaling"]["commit"] == "c2"
    assert data["commit"] == "c2"
    # a rerun of one command replaces its own section only
    update_sections(path, "routing", "python a.py --more", {"routing": []}, commit="c3", machine="m", date="d")
    data = json.loads(path.read_text())
    assert data["routing"] == [] and data["scaling"] == {"att": 0.9}
    assert data["provenance"]["scaling"]["commit"] == "c2" and data["provenance"]["routing"]["commit"] == "c3"


def test_an_earlier_provenance_note_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"command": "x", "commit": "a", "machine": "m", "date": "d", "metrics": {},
                                "provenance": "moved from benchmarks/results/x.json"}))
    update_sections(path, "k", "python k.py", {"k": 1}, commit="b", machine="m", date="d")
    assert json.loads(path.read_text())["provenance"]["earlier"] == "moved from benchmarks/results/x.json"


def test_a_combined_summary_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        update_sections(tmp_path / "big.json", "k", "c", {"rows": ["x" * 200] * 600}, commit="c", machine="m", date="d")
    assert not (tmp_path / "big.json").exists()
