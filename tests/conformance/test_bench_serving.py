"""`sglang.bench_serving`, SGLang's own load generator, end to end against a server with every
plugin, direct and through kllm-router, on its `random` (token ids sampled from a small local
ShareGPT file), `generated-shared-prefix` and `mooncake` (the seeded local trace
`data/mooncake_small.jsonl`) datasets: every request completes and the result file reports it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

TRACE = Path(__file__).parent / "data" / "mooncake_small.jsonl"


def _dataset_args(name: str, sharegpt: Path) -> tuple[list[str], int]:
    if name == "random":
        return ["--dataset-name", "random", "--dataset-path", str(sharegpt), "--random-input-len", "64",
                "--random-output-len", "4", "--random-range-ratio", "0.5", "--num-prompts", "6"], 6
    if name == "generated-shared-prefix":
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
                "--gsp-system-prompt-len", "96", "--gsp-question-len", "16", "--gsp-output-len", "4"], 6
    assert name == "mooncake"
    n = len(TRACE.read_text().splitlines())
    return ["--dataset-name", "mooncake", "--dataset-path", str(TRACE), "--mooncake-num-rounds", "1",
            "--num-prompts", str(n)], n


@pytest.mark.parametrize("target", ["direct", "router"])
@pytest.mark.parametrize("dataset", ["random", "generated-shared-prefix", "mooncake"])
def test_bench_serving_end_to_end(dataset: str, target: str, server_pool: Any, sharegpt_small: Path,
                                  tmp_path: Path, no_proxy_env: None) -> None:
    run = server_pool.behind_router("all") if target == "router" else server_pool.get("all")
    model = run.server.args[run.server.args.index("--model-path") + 1]
    args, expected = _dataset_args(dataset, sharegpt_small)
    out = tmp_path / "result.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", run.base_url,
           "--model", model, "--tokenizer", model, *args, "--request-rate", "inf", "--max-concurrency", "4",
           "--warmup-requests", "1", "--seed", "28", "--disable-tqdm", "--output-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [result] = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert result["completed"] == expected, {k: result.get(k) for k in ("completed", "total_input_tokens")}
    assert result["total_output_tokens"] >= expected
    assert result["total_input_tokens"] > 0
