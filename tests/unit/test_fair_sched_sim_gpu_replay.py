"""The simulated replay of fair_sched's GPU cells: it reads the recorded cells as the GPU harness ran
them, replays the very requests the GPU saw, and the docs tables are the ones built from its summary."""
from __future__ import annotations

import json
from types import ModuleType
from typing import Callable

from kllm_plugins.bench.record import result_path


def test_cells_carry_the_harness_settings_and_measured_ratios(bench_module: Callable[[str, str], ModuleType]) -> None:
    sc = bench_module("fair_sched", "sim_gpu_replay")
    cells = {f"{c['trace']}@{c['chunk']}": c for c in sc.gpu_cells()}
    assert "bursty@2048" in cells and "lognormal@8192" in cells
    old, new = cells["bursty@2048"], cells["lognormal@8192"]
    assert old["cal_requests"] == 24 and new["cal_requests"] == 16  # the default; then the command's flag
    assert old["requests"] == 40 and new["requests"] == 30 and new["load"] == 0.8
    recorded = json.loads((sc.RESULTS / new["file"]).read_text())["metrics"]["lognormal@8192"]["targets"]
    assert new["gpu"]["p99 <= fcfs"] == recorded["p99 <= fcfs"]["value"]


def test_the_model_replays_the_requests_the_gpu_saw(bench_module: Callable[[str, str], ModuleType]) -> None:
    sc = bench_module("fair_sched", "sim_gpu_replay")
    tr = bench_module("fair_sched", "traces")
    c = next(c for c in sc.gpu_cells() if c["trace"] == "issue")
    scale = tr.gpu_scale(2048, c["max_prompt"], *c["out_tokens"])
    recorded = json.loads((sc.RESULTS / c["file"]).read_text())
    fcfs = [r for r in recorded["runs"] if r["trace"] == "issue" and r["policy"] == "fcfs"][0]
    # the GPU run's output tokens are the trace's (same seed, same scale), so the model's trace is the GPU's
    reqs = tr.make("issue", scale, c["requests"], 0)
    assert sum(r.output_len for r in reqs) == round(fcfs["output_tok_s"] * fcfs["wall_s"])
    assert sum(r.output_len for r in tr.make("issue", scale, c["requests"], 1)) != sum(r.output_len for r in reqs)


def test_targets_read_each_limit_its_way(bench_module: Callable[[str, str], ModuleType]) -> None:
    tg = bench_module("fair_sched", "targets")
    base = {"mean": 1.0, "short_p90": 1.0, "p99": 1.0, "long_mean": 1.0, "tpot": 1.0, "throughput": 1.0}

    def met(metric: str, ratio: float) -> bool:
        t = next(name for name, m, *_ in tg.TARGETS if m == metric)
        return tg.check({"fcfs": base, "fair_sched": {**base, metric: ratio}})[t]["met"]

    assert met("tpot", 1.29) and not met("tpot", 1.31)
    assert met("throughput", 0.98) and not met("throughput", 0.97)
    assert met("long_mean", float("nan"))  # no long prompt: nothing to miss
    # the best stock policy among those that ran (a server that died is absent)
    both = tg.check({"fcfs": base, "hrrn": {**base, "mean": 0.5}, "fair_sched": {**base, "mean": 0.6}})
    assert both["mean <= best stock"]["against"] == "hrrn" and not both["mean <= best stock"]["met"]
    sc = bench_module("fair_sched", "sim_gpu_replay")
    assert sc._flag("python x.py --cal-requests 16 --out f", "--cal-requests", "24") == "16"


def test_doc_tables_are_current(bench_module: Callable[[str, str], ModuleType]) -> None:
    sc = bench_module("fair_sched", "sim_gpu_replay")
    summary = json.loads(result_path("fair_sched", "sim_gpu_replay").read_text())
    text = sc.DOC.read_text(encoding="utf-8")
    assert sc.render(text, summary) == text, "run: python benchmarks/fair_sched/sim_gpu_replay.py --write-doc"


def test_the_8_layer_costs_give_back_the_solo_prompts_they_were_fitted_to(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    """The 8-layer H100 check replays that run on costs fitted to it: the run's two solo long
    prompts come back within 2%, the model's capacity (with the run's KV pool) within 10% of the run's, and the GPU's ratios
    are read from the recorded runs (ts2's TPOT over fcfs's)."""
    chk = bench_module("fair_sched", "sim_h100_8l_check")
    se = bench_module("fair_sched", "sim_engine")
    d = json.loads(chk.GPU.read_text())
    cal = d["calibration"]["issue@2048"]
    for n, measured in cal["solo_long_ttft_s"].items():
        model = sum(se.COSTS["h100_8l"].prefill([(2048, 2048 * i)]) for i in range(int(n) // 2048))
        assert abs(model / measured - 1) < 0.02, (n, model, measured)
    cap = chk.replay("issue", d["settings"], 1, d["settings"]["pool_tokens"])["capacity_req_s"]  # the run's KV pool
    assert abs(cap / cal["capacity_req_s"] - 1) < 0.10
    runs = {r["policy"]: r for r in d["runs"] if r["trace"] == "issue"}
    want = runs["fair_sched/ts2"]["tpot_s"]["mean"] / runs["fcfs"]["tpot_s"]["mean"]
    assert chk.gpu_ratios(d, "issue")["fair_sched/ts2"]["tpot"] == round(want, 3)
