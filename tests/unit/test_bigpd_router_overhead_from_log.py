"""`bench_overhead --bs-from-log`: the rounds a run cut by its time limit printed are recorded, not
those of an earlier finished run in the same log, and not a round cut halfway."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest


def _row(rnd: int, target: str) -> str:
    return json.dumps({"round": rnd, "target": target, "completed": 4, "output_tokens": 64,
                       "median_ttft_ms": 10.0 + rnd})


def _cpu(rnd: int, output_len: int, cpu_s: float) -> str:
    return json.dumps({"cpu": "run", "round": rnd, "target": "kllm", "output_len": output_len, "completed": 4,
                       "output_tokens": 4 * output_len, "cpu_s": cpu_s, "wall_s": 1.0})


def test_rows_after_the_last_summary_complete_rounds_only(
        bench_module: Callable[[str, str], ModuleType], tmp_path: Path) -> None:
    bo = bench_module("bigpd_router", "bench_overhead")
    log = tmp_path / "router_bs.log"
    log.write_text("\n".join([
        _row(0, "direct"), _row(0, "kllm"),
        "sglang.bench_serving via kllm-router vs direct, fake backend, 1 interleaved rounds: ...",
        "[12:52:30 kllm pid=7] kllm_cuda platform (pid 7): NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, ...",
        _cpu(0, 64, 0.05), _cpu(0, 8, 0.02),
        _row(0, "direct"), _row(0, "kllm"), _cpu(1, 64, 0.07), _row(1, "kllm"), _row(1, "direct"),
        _cpu(2, 64, 0.9), _row(2, "direct"),
    ]) + "\n")
    rows, rounds, device, cpu_rows = bo.rows_from_log(str(log))
    assert rounds == 2 and len(rows) == 4 and {r["round"] for r in rows} == {0, 1}
    assert device == "NVIDIA H100 80GB HBM3"
    # the CPU rows of the complete rounds only: the router's CPU of its full-length runs is their sum
    assert [r["round"] for r in cpu_rows] == [0, 0, 1]
    assert bo.router_cpu_s(cpu_rows, "kllm", 64) == pytest.approx(0.12)
    assert bo.router_cpu_s(cpu_rows, "baseline", 64) is None
    log.write_text(_row(0, "direct") + "\n" + _row(0, "kllm") + "\n")
    with pytest.raises(SystemExit, match="fewer than two complete rounds"):
        bo.rows_from_log(str(log))


def test_auto_pin_splits_physical_cores_so_server_and_router_share_none(
        bench_module: Callable[[str, str], ModuleType]) -> None:
    bo = bench_module("bigpd_router", "bench_overhead")
    # 16 CPUs, hyperthread siblings n and n+8 (one layout clouds use), two packages of 4 cores
    topo = {cpu: (cpu % 8 // 4, cpu % 4) for cpu in range(16)}
    server, router = bo.split_by_core(topo)
    s, r = bo.cpu_list(server), bo.cpu_list(router)
    assert s | r == set(range(16)) and not s & r and len(s) == len(r) == 8
    assert not {topo[c] for c in s} & {topo[c] for c in r}  # no physical core on both sides
    assert bo.split_by_core({0: (0, 0), 1: (0, 0)}) is None  # one core: nothing to split
    assert bo.parse_pin("1:0") == ("1", "0") and bo.parse_pin("x:0") is None
