"""Drafters trained a few steps on the tiny Llama load into SGLang 0.5.23's real DSPARK draft
model class on CPU: every weight, no missing or unexpected key, and the Markov/confidence heads
compute what ours compute. One checkpoint comes from the training command end to end (ShareGPT
replaced by fixed random prompts so the test needs no corpus), three from the training API (one
trained with the tied Markov head, exported materialised)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.sglang

CHECK = Path(__file__).with_name("dspark_load_check.py")


def _prompts(path: Path, vocab: int) -> Path:
    from kllm_plugins.plugins.dspark.training.data import TokenizedPrompts

    g = torch.Generator().manual_seed(0)
    mk = lambda n: [torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
                    for _ in range(n)]
    TokenizedPrompts(mk(6), mk(2), mk(2), eos_id=-1, source="random ids (test)").save(path)
    return path


def _train_api(head: str, out: Path, target_path: Path, tied: bool = False) -> Path:
    from dataclasses import replace

    from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, build_drafter
    from kllm_plugins.plugins.dspark.train import drafter_config, load_hf_target
    from kllm_plugins.plugins.dspark.training.export import write_checkpoint
    from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, train_drafter

    target, _ = load_hf_target(target_path, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(3, 4096, (24,), generator=g).tolist(), 6) for _ in range(8)]
    cfg = drafter_config("dspark", target.shape, layers=1, block_size=4, target_layers=[0, 2], mask_token_id=2,
                         markov_rank=8, markov_head_type=head)
    model = build_drafter(replace(cfg, markov_tied=tied))
    hist = train_drafter(target, model, seqs, TrainConfig(steps=2, batch_size=4, anchors_per_seq=4, log_every=1))
    assert len(hist) == 2
    return write_checkpoint(model, out, num_target_layers=target.shape.num_layers, temperatures=[1.0, 1.5, 2.0, 2.5],
                            shared=SharedTarget(target.embed, target.lm_head))


def test_trained_checkpoints_load_into_sglang_dspark_draft_model(tmp_path: Path, tiny_model_path: Path) -> None:
    from kllm_plugins.plugins.dspark import train

    cli_out = tmp_path / "draft-rnn"
    rc = train.main([
        "--target", str(tiny_model_path), "--out", str(cli_out), "--kind", "dspark", "--markov-head-type", "rnn",
        "--markov-rank", "16", "--layers", "1", "--block-size", "4", "--target-layers", "1,2",
        "--prompts", str(_prompts(tmp_path / "p.pt", 4096)), "--max-answer-tokens", "10", "--steps", "3",
        "--batch-size", "4", "--anchors-per-seq", "4", "--device", "cpu",
        # run 7's regime through the command: sampled answers, 0.1 CE + 0.9 TV (same checkpoint format)
        "--answer-temperature", "0.7", "--w-ce", "0.1", "--w-tv", "0.9",
    ])
    assert rc == 0
    meta = json.loads((cli_out / "kllm_drafter.json").read_text())
    assert len(meta["history"]) >= 2 and meta["calibration"]["test_samples"] > 0
    assert meta["loss"] == {"w_ce": 0.1, "w_tv": 0.9} and meta["answer_temperature"] == 0.7
    assert "tv" in meta["history"][0]
    folders = {"rnn": cli_out, "gated": _train_api("gated", tmp_path / "draft-gated", tiny_model_path),
               "vanilla": _train_api("vanilla", tmp_path / "draft-vanilla", tiny_model_path),
               # trained with the tied (factorised) Markov head, exported as the equivalent untied head
               "gated_tied": _train_api("gated", tmp_path / "draft-gated-tied", tiny_model_path, tied=True)}

    env = {**os.environ, "SGLANG_PLATFORM": "kllm_cpu"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    proc = subprocess.run([sys.executable, str(CHECK), str(tiny_model_path), *map(str, folders.values())],
                          capture_output=True, text=True, timeout=300, env=env)
    results = {json.loads(ln[7:])["folder"]: json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")}
    assert proc.returncode == 0 and len(results) == len(folders), proc.stderr[-3000:]
    expect = {"vanilla": "VanillaMarkov", "gated": "GatedMarkovHead", "rnn": "RNNHead"}
    for head, folder in folders.items():
        res = results[str(folder)]
        assert res["arch"] == "DSparkDraftModel" and res["class"] == "DSparkDraftModel"
        assert res["markov_head"] == expect[head.split("_")[0]]
        assert res["missing"] == [] and res["unexpected"] == [], res
        assert res["keys"] >= res["params"] > 0
        assert res["sts_temperatures"] == 4 and res["gamma"] == 4
        for name, err in res["checks"].items():
            assert err < 1e-5, (head, name, err)
    rnn = results[str(folders["rnn"])]
    assert (rnn["markov_rank"], rnn["target_layer_ids"]) == (16, [1, 2])
    assert rnn["mask_token_id"] == meta["config"]["mask_token_id"]
