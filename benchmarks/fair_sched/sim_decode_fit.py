"""The simulated clock's decode costs for the 8-layer H100, fitted to fcfs on the GPU (a model fit).

`sim_engine.COSTS["h100_8l"]` took its decode step (5.5 ms, `PRIOR`) from fcfs's mean TPOT on one
`issue` run, which holds the stalls a decode suffers behind prefill passes as well as the step
itself. This refits that one number (`dec_base`; `sim_engine` now carries the fit) on what fcfs did
on every H100 8-layer run recorded at several loads (issue 27's; `gpu_*_8l_h100.json` whose
`settings.load` is a list) at chunk 2048 (`FIT_CHUNK`):

* fcfs's mean TPOT in each cell, replayed on the GPU's own seeds at the GPU's own rate (its
  measured capacity times the load) with the run's KV pool;
* the capacity each run measured (16 requests of the trace sent at once), per trace and chunk.

The fit is the step on a grid with the smallest root-mean-square log error over both. The cells at
other chunks (8192), and those recorded after the fit was made (`FIT_UNTIL`), are held out: their
error at the fitted step, and the step a fit over every cell would pick, are printed and recorded
beside it. The
per-request decode cost (`dec_row`) stays a quarter of the H200's: raised together with a smaller
step it fits as well (a valley from 1.5 ms + 400 us to 3.5 ms + 7.8 us, RMS 0.078-0.089, found by
hand on a grid), so these runs do not tell the two apart. The other policies' TPOT and mean TTFT
ratios to fcfs, which the fit did not see, are printed beside the GPU's as the check: every
server a file ran, its model setup taken from the file's own settings (`checked`).

    python benchmarks/fair_sched/sim_decode_fit.py [--record]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402
import serving  # noqa: E402
import sim_engine as se  # noqa: E402
import traces as tr  # noqa: E402
from sim_gpu_replay import seed_runs  # noqa: E402

from kllm_plugins.bench.record import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "fair_sched"
OUT = "sim_decode_fit_h100_8l"  # benchmarks/results/fair_sched/<this>.json
GRID_MS = [x / 4 for x in range(8, 25)]  # dec_base 2.0 .. 6.0 ms
PRIOR_MS = 5.5  # the decode step `h100_8l` carried before this fit
FIT_UNTIL = "2026-12-07T08"  # runs recorded from then on were not there when the fit was made: held out
FIT_CHUNK = 2048  # the cells the fit sees; the others are held out


def checked(settings: dict[str, Any]) -> dict[str, tuple[Any, list[str] | None]]:
    """The servers a GPU file ran, other than fcfs, by their name in it: (model policy, fair_sched
    options, None for a stock order). From the file's own settings: its `--variant`s
    (`serving.parse_variant`) and its stock orders with SGLang's mixed chunk (`--mixed-chunk-stock`).
    lpm is left out: the model has no prefix cache, so it is fcfs there."""
    out: dict[str, tuple[Any, list[str] | None]] = {
        p: (p, None) for p in settings["policies"] if p in se.STOCK and p != "fcfs"}
    if "fair_sched" in settings["policies"]:
        out["fair_sched"] = ("fair_sched", [])
    for p in settings.get("mixed_chunk_stock") or []:
        out[f"{p}+mixed"] = (se.EngineWith(p, mixed=True), None)
    for spec in settings.get("variants") or []:
        name, env = serving.parse_variant(spec)
        out[name] = ("fair_sched", [f"{k}={v}" for k, v in env.items()])  # grid.config_from reads KLLM_ names
    return out


def cells(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every H100 8-layer cell at several loads with fcfs in it: trace, load, the GPU's rate, seeds
    and per-policy seed means (TPOT, mean TTFT) on the seeds the cell compares."""
    out = []
    for path in sorted(folder.glob("gpu_*_8l_h100.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        s = d["settings"]
        if not isinstance(s.get("load"), list):
            continue  # one load (the load-0.8 family): not issue 27's loads
        for key, cell in d["metrics"].items():
            trace, chunk, load = key.split("@")
            if "fcfs" not in cell:
                continue
            seeds = sorted({r["seed"] for r in d["runs"] if r["policy"] == "fcfs" and r["trace"] == trace
                            and r["load"] == float(load)} - set(cell.get("seeds_left_out", [])))
            gpu = {p: {"tpot": f["tpot_s_mean"]["mean"], "mean": f["ttft_s_mean"]["mean"]}
                   for p, f in cell.items() if isinstance(f, dict) and "tpot_s_mean" in f and p not in cell.get("exited", [])}
            out.append({"file": path.name, "date": d["date"], "trace": trace, "chunk": int(chunk), "load": float(load), "seeds": seeds,
                        "capacity": d["calibration"][f"{trace}@{chunk}"]["capacity_req_s"],
                        "rate": float(load) * d["calibration"][f"{trace}@{chunk}"]["capacity_req_s"],
                        "settings": s, "gpu": gpu})
    return out


def fitted(c: dict[str, Any]) -> bool:
    """A cell the fit sees: at `FIT_CHUNK`, recorded before `FIT_UNTIL`."""
    return c["chunk"] == FIT_CHUNK and c["date"] < FIT_UNTIL


def _runs(c: dict[str, Any], cm: se.Costs, policy: Any, env: list[str] | None) -> dict[str, float]:
    s = c["settings"]
    scale = tr.gpu_scale(s["trace_chunk"], s["max_prompt"], *s["output_tokens"])
    jobs = [tr.make(c["trace"], scale, s["requests"], seed) for seed in c["seeds"]]
    rows = seed_runs(jobs, c["rate"], c["chunk"], cm, 8 * s["trace_chunk"] - 1, policy, env or [],
                     overlap=env is not None, lag=1, pool=s["pool_tokens"])
    return {k: statistics.fmean(r[k] for r in rows) for k in ("tpot", "mean")}


def _costs(ms: float) -> se.Costs:
    return dataclasses.replace(se.COSTS["h100_8l"], dec_base=ms / 1e3)


def capacities(cs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per trace and chunk (`trace@chunk`): the capacities the GPU runs measured (their mean), and
    what to replay."""
    out: dict[str, dict[str, Any]] = {}
    for c in cs:
        t = out.setdefault(f"{c['trace']}@{c['chunk']}",
                           {"trace": c["trace"], "gpu": [], "settings": c["settings"], "chunk": c["chunk"]})
        if c["capacity"] not in t["gpu"]:
            t["gpu"].append(c["capacity"])
    return out


def _capacity(t: dict[str, Any], cm: se.Costs) -> float:
    s = t["settings"]
    scale = tr.gpu_scale(s["trace_chunk"], s["max_prompt"], *s["output_tokens"])
    return se.capacity(tr.make(t["trace"], scale, s["cal_requests"], 99), t["chunk"], cm, pool_tokens=s["pool_tokens"])


def log_errors(cs: list[dict[str, Any]]) -> dict[float, list[float]]:
    """For each `dec_base` on the grid: the log errors of fcfs's mean TPOT per cell and of the
    capacity per trace and chunk (cells of different chunks add up: their capacities do not mix)."""
    caps = capacities(cs)
    out = {}
    for ms in GRID_MS:
        cm = _costs(ms)
        out[ms] = [math.log(_runs(c, cm, "fcfs", None)["tpot"] / c["gpu"]["fcfs"]["tpot"]) for c in cs]
        out[ms] += [math.log(_capacity(t, cm) / statistics.fmean(t["gpu"])) for t in caps.values()]
    return out


def fit(cs: list[dict[str, Any]], logs: dict[float, list[float]] | None = None) -> dict[str, Any]:
    """The RMS log error (of `log_errors(cs)`, or `logs` when given) for each `dec_base` on the
    grid, and the best."""
    errs = {ms: math.sqrt(statistics.fmean(x * x for x in xs)) for ms, xs in (logs or log_errors(cs)).items()}
    best = min(errs, key=errs.__getitem__)
    return {"rms_log_error": {f"{k:g}": round(v, 4) for k, v in errs.items()}, "dec_base_ms": best,
            "was_ms": PRIOR_MS}


def check(cs: list[dict[str, Any]], dec_base_ms: float) -> dict[str, Any]:
    """Per cell: fcfs's TPOT (GPU / model) and each other policy's TPOT and mean ratios to fcfs,
    GPU / model at the old and the fitted decode step."""
    out: dict[str, Any] = {}
    costs = {"old": _costs(PRIOR_MS), "fit": _costs(dec_base_ms)}
    for c in cs:
        key = f"{c['trace']}@{c['chunk']}@{c['load']} ({c['file']})"
        fc = {k: _runs(c, cm, "fcfs", None) for k, cm in costs.items()}
        row: dict[str, Any] = {"fcfs_tpot_ms": {"gpu": c["gpu"]["fcfs"]["tpot"] * 1e3,
                                                **{k: v["tpot"] * 1e3 for k, v in fc.items()}}}
        for name, (policy, env) in checked(c["settings"]).items():
            if name not in c["gpu"]:
                continue
            g, f = c["gpu"][name], c["gpu"]["fcfs"]
            m = {k: _runs(c, cm, policy, env) for k, cm in costs.items()}
            row[name] = {q: {"gpu": g[q] / f[q], **{k: m[k][q] / fc[k][q] for k in costs}} for q in ("tpot", "mean")}
        out[key] = row
    for key, t in capacities(cs).items():
        out[f"capacity {key}"] = {"gpu": statistics.fmean(t["gpu"]), **{k: _capacity(t, cm) for k, cm in costs.items()}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    cs = cells()
    seen = [c for c in cs if fitted(c)]
    held = [c for c in cs if not fitted(c)]
    seen_logs = log_errors(seen)
    f = fit(seen, seen_logs)
    print(f"RMS log error of fcfs's mean TPOT ({len(seen)} cells at chunk {FIT_CHUNK}) and capacity, by decode "
          "step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in f["rms_log_error"].items()))
    print(f"fit: {f['dec_base_ms']:g} ms (was {PRIOR_MS:g} ms)")
    if held:
        held_logs = log_errors(held)
        h, every = fit(held, held_logs), fit(cs, {ms: seen_logs[ms] + held_logs[ms] for ms in GRID_MS})
        f["held_out"] = {"cells": len(held), "rms_log_error_at_fit": h["rms_log_error"][f"{f['dec_base_ms']:g}"],
                         "their_own_fit_ms": h["dec_base_ms"],
                         "fit_over_every_cell_ms": every["dec_base_ms"],
                         "fit_over_every_cell_rms": every["rms_log_error"][f"{every['dec_base_ms']:g}"]}
        print(f"held out ({len(held)} cells at other chunks or recorded later): RMS {f['held_out']['rms_log_error_at_fit']:.3f} at the "
              f"fit; their own fit {h['dec_base_ms']:g} ms; a fit over every cell {every['dec_base_ms']:g} ms (RMS "
              f"{f['held_out']['fit_over_every_cell_rms']:.3f})")
    chk = check(cs, f["dec_base_ms"])
    for key, row in chk.items():
        if key.startswith("capacity"):
            print(f"{key}: GPU {row['gpu']:.2f} / model old {row['old']:.2f} / fit {row['fit']:.2f} req/s")
            continue
        t = row["fcfs_tpot_ms"]
        print(f"{key}: fcfs TPOT ms GPU {t['gpu']:.1f} / model old {t['old']:.1f} / fit {t['fit']:.1f}")
        for name, v in row.items():
            if name != "fcfs_tpot_ms":
                print(f"  {name:30s} " + "  ".join(f"{q} vs fcfs {v[q]['gpu']:.2f} / {v[q]['old']:.2f} / {v[q]['fit']:.2f}"
                                                   for q in ("tpot", "mean")))
    if a.record:
        out = record("fair_sched", OUT, "python benchmarks/fair_sched/sim_decode_fit.py --record", chk,
                     shared=grid.SIM_SHARED, fit=f, cells=len(seen),
                     columns="GPU / model with the old decode step / with the fitted one",
                     kind="simulation: the 8-layer H100 decode step fitted to fcfs's TPOT on the GPU")
        print(f"recorded {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
