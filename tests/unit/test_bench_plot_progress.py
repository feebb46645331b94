"""The harness's plot and progress helpers (no SGLang)."""
from __future__ import annotations

import builtins
import io
from pathlib import Path
from typing import Any

import pytest

from kllm_plugins.bench import plot
from kllm_plugins.bench.progress import Progress, track


def test_figure_without_matplotlib_yields_none_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    real = builtins.__import__

    def no_mpl(name: str, *a: Any, **k: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    out = tmp_path / "f.png"
    with plot.figure(str(out)) as axes:
        assert axes is None
    assert not out.exists() and "matplotlib is not installed" in capsys.readouterr().err


def test_figure_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "f.png"
    with plot.figure(str(out), rows=1, cols=2) as axes:
        assert len(axes) == 1 and len(axes[0]) == 2
        axes[0][0].plot([1, 2], [3, 4])
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_progress_lines_count_and_estimate_the_time_left() -> None:
    now = [100.0]
    buf = io.StringIO()
    p = Progress(4, "grid", width=8, stream=buf, clock=lambda: now[0])
    now[0] += 30
    p.step("fcfs s0")
    now[0] += 30
    p.step()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "grid [##......] 1/4 25% 30s, about 1m30s left: fcfs s0"
    assert lines[1] == "grid [####....] 2/4 50% 1m00s, about 1m00s left"
    p.step(n=5)  # never past the total, no time left shown at the end
    assert buf.getvalue().splitlines()[-1] == "grid [########] 4/4 100% 1m00s"
    with pytest.raises(ValueError):
        Progress(-1)


def test_track_steps_after_each_item() -> None:
    buf = io.StringIO()
    assert list(track(range(3), "sweep", stream=buf)) == [0, 1, 2]
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("sweep [####################] 3/3 100%")
