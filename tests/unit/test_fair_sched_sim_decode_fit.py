"""The 8-layer H100 decode step of the simulated clock is the one fitted to fcfs on the GPU cells
at the fit's chunk recorded before it (the cells at other chunks or recorded later are held out)."""
from __future__ import annotations

from types import ModuleType
from typing import Callable


def test_the_h100_decode_step_is_the_fit_to_the_recorded_gpu_cells(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    fit = bench_module("fair_sched", "sim_decode_fit")
    se = bench_module("fair_sched", "sim_engine")
    every = fit.cells()
    assert all(c["seeds"] and "fcfs" in c["gpu"] for c in every)
    cells = [c for c in every if fit.fitted(c)]
    assert len(cells) >= 10
    f = fit.fit(cells)
    errors = f["rms_log_error"]
    # the fitted step beats the old one by a wide margin, and sim_engine carries it
    assert errors[f"{f['dec_base_ms']:g}"] < 0.5 * errors[f"{fit.PRIOR_MS:g}"]
    assert f["was_ms"] == fit.PRIOR_MS
    assert se.COSTS["h100_8l"].dec_base * 1e3 == f["dec_base_ms"]
