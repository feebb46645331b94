"""The GPU DSPARK serving driver's random drafter (benchmarks/gpu/dspark_serving_gpu.py): for the
tiny target it is a draft checkpoint that SGLang 0.5.23's own DSPARK config parsers accept, with a
confidence head (ragged verify allowed). No server; SGLang's parser is plain Python."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

pytestmark = pytest.mark.sglang


def test_random_drafter_for_the_tiny_target_passes_sglangs_dspark_parser(
        tmp_path: Path, tiny_model_path: Path, bench_module: Callable[[str, str], ModuleType]) -> None:
    pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_config")
    from safetensors import safe_open

    driver = bench_module("gpu", "dspark_serving_gpu")
    folder = driver.build_random_drafter(tiny_model_path, tmp_path / "draft", layers=1, block_size=4, markov_rank=16)
    cfg = json.loads((folder / "config.json").read_text())
    target = json.loads((tiny_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["enable_confidence_head"] is True

    got = driver.parse_check(folder, target["vocab_size"], target["num_hidden_layers"])
    assert (got["gamma"], got["verify_num_draft_tokens"], got["layers"]) == (4, 5, 1)
    assert (got["markov_rank"], got["markov_head_type"]) == (16, "vanilla")
    # every id SGLang can capture: layer i is read as the input of layer i + 1
    assert got["target_layer_ids"] == [1, 2] and max(got["target_layer_ids"]) <= target["num_hidden_layers"] - 2
    assert got["mask_token_id"] == cfg["mask_token_id"] < target["vocab_size"]
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert any(k.startswith("confidence_head.") for k in keys) and any(k.startswith("markov_head.") for k in keys)
    assert len(json.loads((folder / "dspark_sts.json").read_text())["temperatures"]) == 4
