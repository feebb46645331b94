"""The fair_sched GPU rows: targets on seed means per trace and chunk (best stock among the servers
that ran), and the docs table built from the recorded files."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest


def _run(trace: str, chunk: int, policy: str, seed: int, mean: float, p99: float, tpot: float = 0.02,
         thr: float = 1.0) -> dict[str, Any]:
    q = {"mean": mean, "p50": mean, "p90": mean, "p99": p99}
    return {"trace": trace, "chunk": chunk, "policy": policy, "seed": seed, "ttft_s": q, "ttft_short_s": q,
            "ttft_long_s": {"mean": p99}, "tpot_s": {"mean": tpot}, "long_ttft_over_solo": {"max": 1.0},
            "throughput_req_s": thr}


def test_targets_use_seed_means_and_the_best_stock_policy_that_ran(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    runs = [_run("t", 2048, "fcfs", s, 4.0, 10.0) for s in (0, 1)]
    runs += [_run("t", 2048, "hrrn", 0, 2.0, 11.0), _run("t", 2048, "hrrn", 1, 4.0, 11.0)]  # seed mean 3.0
    runs += [_run("t", 2048, "fair_sched", 0, 3.0, 12.0, tpot=0.03, thr=0.97), _run("t", 2048, "fair_sched", 1, 2.4, 8.0)]
    runs += [_run("u", 8192, "fcfs", 0, 1.0, 1.0)]  # no fair_sched there: no targets
    m = g.metrics(runs)
    assert set(m) == {"t@2048", "u@8192"} and "targets" not in m["u@8192"]
    t = m["t@2048"]["targets"]
    assert t["mean <= best stock"]["against"] == "hrrn" and t["mean <= best stock"]["value"] == pytest.approx(0.9)
    assert t["mean <= best stock"]["met"]
    assert t["p99 <= fcfs"]["value"] == pytest.approx(1.0) and t["p99 <= fcfs"]["met"]
    assert t["tpot <= 1.3x fcfs"]["value"] == pytest.approx(1.25)
    assert t["throughput >= 0.98x fcfs"]["value"] == pytest.approx(0.985) and t["throughput >= 0.98x fcfs"]["met"]
    assert m["t@2048"]["fair_sched"]["seeds"] == 2


def test_gpu_table_rows_are_sorted_and_name_stock_servers_that_exited(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    st = bench_module("fair_sched", "server_table")
    runs = [_run(tr, 8192 if tr == "b" else 2048, p, 0, m, m) for tr in ("b", "a")
            for p, m in (("fcfs", 4.0), ("hrrn", 2.0), ("fair_sched", 3.0))]
    errors = [{"chunk": 8192, "policy": "shortest-prefill-first", "error": "x"},  # warm-up: every trace
              {"chunk": 2048, "trace": "z", "policy": "lpm", "error": "x"}]  # a run of another trace
    doc = {"settings": {"load": 0.8, "requests": 30}, "machine": {"gpu": "NVIDIA H200"},
           "metrics": g.metrics(runs, errors), "errors": errors}
    (tmp_path / "gpu_x.json").write_text(json.dumps(doc))
    lines = st.gpu_table(tmp_path).splitlines()
    assert [ln.split(" | ")[0:2] for ln in lines[2:]] == [["| a", "2048"], ["| b", "8192"]]
    a, b = (ln.split(" | ") for ln in lines[2:])
    assert a[5] == "H200" and a[6] == "before fix" and a[7] == "hrrn" and a[8] == "1.50 *" and a[-1] == "- |"
    assert b[-1] == "shortest-prefill-first |"


def test_a_variant_is_checked_against_the_same_targets_and_gets_its_own_row(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    st = bench_module("fair_sched", "server_table")
    runs = [_run("a", 2048, p, 0, m, m, tpot=t) for p, m, t in
            (("fcfs", 4.0, 0.02), ("hrrn", 2.0, 0.02), ("fair_sched", 3.0, 0.04), ("fair_sched/ts", 1.8, 0.022))]
    m = g.metrics(runs)
    vt = m["a@2048"]["variant_targets"]["fair_sched/ts"]
    assert vt["mean <= best stock"]["value"] == pytest.approx(0.9) and vt["mean <= best stock"]["met"]
    assert vt["tpot <= 1.3x fcfs"]["value"] == pytest.approx(1.1) and vt["tpot <= 1.3x fcfs"]["met"]
    assert not m["a@2048"]["targets"]["tpot <= 1.3x fcfs"]["met"]  # the defaults' own check is unchanged
    runs[-1]["fair_sched_counters"] = {"timing_lag": 1.0}  # recorded by the drivers since the timing fix
    doc = {"settings": {"load": 0.8, "requests": 30, "layers": 16, "variants": ["ts:decode_time_share=0.2"]},
           "machine": {"gpu": "NVIDIA H200"}, "metrics": m, "runs": runs}
    (tmp_path / "gpu_v.json").write_text(json.dumps(doc))
    rows = [ln.split(" | ") for ln in st.gpu_table(tmp_path).splitlines()[2:]]
    assert [r[0] for r in rows] == ["| a", "| a, fair_sched/ts (decode_time_share=0.2)"]
    assert rows[0][5] == rows[1][5] == "H200, 16 layers"
    assert (rows[0][6], rows[1][6]) == ("before fix", "lag 1")  # pass timing as each policy's runs recorded it
    assert rows[0][12] == "2.00 *" and rows[1][12] == "1.10"  # TPOT vs fcfs: defaults missed, variant met


def test_outputs_column_gives_fair_scheds_share_and_names_stock_policies_that_differ(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    st = bench_module("fair_sched", "server_table")
    assert st.outputs_cell({"lpm": 1.0, "fair_sched": 1.0}) == "yes"
    assert st.outputs_cell({"shortest-prefill-first": 0.997222, "fair_sched": 1.0}) == "yes (stock: SPF 99.7%)"
    assert st.outputs_cell({"hrrn": 0.99, "fair_sched": 0.5}) == "NO: 50.0% (stock: hrrn 99.0%)"


def test_a_stock_policy_whose_server_exited_on_a_seed_is_left_out_of_the_targets_and_compared_apart(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    runs = [_run("t", 2048, "fcfs", s, 4.0, 10.0) for s in (0, 1)]
    runs += [_run("t", 2048, "hrrn", s, 3.0, 10.0) for s in (0, 1)]
    runs += [_run("t", 2048, "fair_sched", 0, 1.0, 10.0), _run("t", 2048, "fair_sched", 1, 5.0, 10.0)]  # mean 3.0
    runs += [_run("t", 2048, "shortest-prefill-first", 0, 0.5, 10.0)]  # its server exited before seed 1
    runs += [_run("u", 2048, p, 0, 2.0, 2.0) for p in ("fcfs", "hrrn", "fair_sched")]  # the next trace: SPF gone
    errors = [{"trace": "t", "chunk": 2048, "policy": "shortest-prefill-first", "seed": 1, "error": "x"}]
    m = g.metrics(runs, errors)
    t = m["t@2048"]["targets"]
    # against seed 0 alone SPF (0.5) would look best; on the seeds all ran hrrn (3.0) is
    assert t["mean <= best stock"]["against"] == "hrrn" and t["mean <= best stock"]["value"] == pytest.approx(1.0)
    # ... and fair_sched against SPF on the seed SPF ran is kept, not dropped: 1.0 / 0.5
    assert m["t@2048"]["exited"] == ["shortest-prefill-first"]
    assert m["t@2048"]["exited_stock"]["shortest-prefill-first"] == {"seeds": [0], "mean": 2.0, "short_p90": 2.0}
    assert m["u@2048"]["exited"] == ["shortest-prefill-first"] and "exited_stock" not in m["u@2048"]
    st = bench_module("fair_sched", "server_table")  # the table's last column
    assert st.exited_cell("shortest-prefill-first", m["t@2048"]["exited_stock"]["shortest-prefill-first"]) == (
        "shortest-prefill-first (fair_sched on its 1 seed: mean 2.00, short P90 2.00)")


def test_a_seed_the_time_limit_cut_short_is_left_out_for_every_policy(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    """The call's limit stopped seed 1 after fcfs and hrrn (no error): every policy compares on seed 0."""
    g = bench_module("gpu", "fair_sched_gpu")
    runs = [_run("t", 2048, p, 0, m, m) for p, m in (("fcfs", 4.0), ("hrrn", 2.0), ("fair_sched", 3.0))]
    runs += [_run("t", 2048, p, 1, 9.0, 9.0) for p in ("fcfs", "hrrn")]
    m = g.metrics(runs)["t@2048"]
    assert m["seeds_left_out"] == [1] and "exited" not in m
    assert {p: m[p]["seeds"] for p in ("fcfs", "hrrn", "fair_sched")} == {"fcfs": 1, "hrrn": 1, "fair_sched": 1}
    assert m["targets"]["mean <= best stock"]["value"] == pytest.approx(1.5)
    path = tmp_path / "gpu_cut.json"  # --recompute derives the same from a recorded file
    path.write_text(json.dumps({"runs": runs, "metrics": {}}))
    g.recompute(str(path))
    assert json.loads(path.read_text())["metrics"]["t@2048"]["seeds_left_out"] == [1]


def test_a_file_with_several_loads_gets_one_cell_and_one_row_per_load(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    st = bench_module("fair_sched", "server_table")
    runs = []
    for load, fair in ((0.6, 3.0), (0.85, 5.0)):  # fair_sched meets the mean at 0.6 only
        for p, m in (("fcfs", 4.0), ("hrrn", 4.0), ("fair_sched", fair)):
            runs.append({**_run("a", 2048, p, 0, m, m), "load": load})
    runs.append({**_run("a", 2048, "lpm", 0, 4.0, 4.0), "load": 0.6})  # its server exits at 0.85 (below)
    errors = [{"chunk": 2048, "trace": "a", "load": 0.85, "policy": "lpm", "seed": 0, "error": "x"}]
    m = g.metrics(runs, errors)
    assert set(m) == {"a@2048@0.6", "a@2048@0.85"}
    assert m["a@2048@0.6"]["targets"]["mean <= best stock"]["met"]
    assert not m["a@2048@0.85"]["targets"]["mean <= best stock"]["met"]
    doc = {"settings": {"load": [0.6, 0.85], "requests": 30}, "machine": {"gpu": "NVIDIA H100 80GB HBM3"},
           "metrics": m, "runs": runs, "errors": errors}
    (tmp_path / "gpu_loads.json").write_text(json.dumps(doc))
    rows = [ln.split(" | ") for ln in st.gpu_table(tmp_path).splitlines()[2:]]
    assert [(r[2], r[8]) for r in rows] == [("0.6", "0.75"), ("0.85", "1.25 *")]
    assert rows[0][-1] == "- |" and rows[1][-1] == "lpm |"  # the exited server named at its load only


def test_a_stock_policy_with_mixed_chunk_is_a_candidate_not_a_baseline(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    """`--mixed-chunk-stock`: SPF with --enable-mixed-chunk is checked against the plain stock
    policies (its better mean does not raise the bar for fair_sched) and gets its own row."""
    g = bench_module("gpu", "fair_sched_gpu")
    st = bench_module("fair_sched", "server_table")
    assert g.mixed_stock("shortest-prefill-first+mixed") == "shortest-prefill-first"
    assert g.mixed_stock("fair_sched") is None and g.mixed_stock("nope+mixed") is None
    runs = [_run("a", 2048, p, 0, m, m, tpot=t) for p, m, t in
            (("fcfs", 4.0, 0.02), ("shortest-prefill-first", 2.0, 0.04), ("fair_sched", 2.2, 0.04),
             ("shortest-prefill-first+mixed", 1.5, 0.025))]
    m = g.metrics(runs)
    assert m["a@2048"]["targets"]["mean <= best stock"]["value"] == pytest.approx(1.1)  # against SPF, not SPF+mixed
    vt = m["a@2048"]["variant_targets"]["shortest-prefill-first+mixed"]
    assert vt["mean <= best stock"]["value"] == pytest.approx(0.75) and vt["tpot <= 1.3x fcfs"]["met"]
    doc = {"settings": {"load": 0.8, "requests": 30, "layers": 8, "mixed_chunk_stock": ["shortest-prefill-first"]},
           "machine": {"gpu": "NVIDIA H100"}, "metrics": m, "runs": runs}
    (tmp_path / "gpu_m.json").write_text(json.dumps(doc))
    rows = [ln.split(" | ") for ln in st.gpu_table(tmp_path).splitlines()[2:]]
    assert [r[0] for r in rows] == ["| a", "| a, shortest-prefill-first+mixed (--enable-mixed-chunk)"]
    assert rows[1][6] == "-" and rows[1][8] == "0.75" and rows[1][12] == "1.25"  # no pass timing; met


def test_prefill_only_runs_have_no_tpot_to_miss_and_only_their_own_table(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    st = bench_module("fair_sched", "server_table")
    nan = float("nan")
    runs = [_run("t", 2048, p, 0, m, 10.0, tpot=nan) for p, m in (("fcfs", 4.0), ("hrrn", 2.0), ("fair_sched", 1.5))]
    m = g.metrics(runs)
    t = m["t@2048"]["targets"]
    assert t["tpot <= 1.3x fcfs"]["met"] and t["tpot <= 1.3x fcfs"]["value"] != t["tpot <= 1.3x fcfs"]["value"]
    assert t["mean <= best stock"]["value"] == pytest.approx(0.75) and t["mean <= best stock"]["met"]
    doc = {"settings": {"load": 0.8, "requests": 30, "prefill_only": True}, "machine": {"gpu": "NVIDIA H200"},
           "metrics": m}
    (tmp_path / "pd_prefill_gpu_t_2048.json").write_text(json.dumps(doc))
    assert len(st.gpu_table(tmp_path).splitlines()) == 2  # the one-server table: header only
    row = st.gpu_table(tmp_path, st.PD_GPU).splitlines()[2].split(" | ")
    assert row[0] == "| t" and row[8] == "0.75" and row[12] == "-" and row[14] == "- / -"


def test_prefill_only_jobs_end_at_their_first_token(bench_module: Callable[[str, str], ModuleType]) -> None:
    g = bench_module("gpu", "fair_sched_gpu")
    import traces as tr

    reqs = tr.make("issue", tr.gpu_scale(2048, 40960, 32, 128), 6, 0)
    assert {j.max_new_tokens for j in g.jobs_of(reqs, 1.0, "s", 2048, "x", True)} == {1}
    assert [j.max_new_tokens for j in g.jobs_of(reqs, 1.0, "s", 2048, "x")] == [r.output_len for r in reqs]


def test_a_run_where_nothing_decodes_has_tpot_nan_and_the_rest_summarized(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    bench_module("gpu", "fair_sched_gpu")  # puts benchmarks/fair_sched on the path
    import serving
    import workload

    outs = [serving.Outcome(f"r{i}", "short", 64, 0.1 * i, 0.2 + i, 0.2 + i, 1, [7], "length") for i in range(4)]
    s = workload.summarize(outs, 2.0, lambda n: 1.0)
    assert s["tpot_s"]["mean"] != s["tpot_s"]["mean"]
    assert s["ttft_s"]["mean"] == pytest.approx(1.7) and s["throughput_req_s"] == pytest.approx(2.0)
