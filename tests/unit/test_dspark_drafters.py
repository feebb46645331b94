"""Drafters: training-time forward equals inference-time drafting; training lowers the loss;
calibration; the ShareGPT reader; layering (no SGLang import)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kllm_plugins.plugins.dspark.core.calibration import calibrated, ece, fit_position_temperatures, fit_temperature
from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner
from kllm_plugins.plugins.dspark.core.drafters import DrafterConfig, SharedTarget, build_drafter, parameter_count
from kllm_plugins.plugins.dspark.training.sharegpt import first_user_prompts, iter_conversations

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import drafter_for, random_target  # noqa: E402


@pytest.mark.parametrize("kind,head", [("dspark", "vanilla"), ("dspark", "gated"), ("dspark", "rnn"),
                                       ("dflash", "vanilla"), ("eagle", "vanilla")])
def test_training_forward_matches_inference_drafting(kind: str, head: str) -> None:
    """Teacher-forced training logits on the sequence the drafter itself drafted reproduce its drafts."""
    target = random_target(32, seed=7)
    gamma = 4
    model = drafter_for(target, kind, gamma=gamma, head=head, seed=1)
    shared = SharedTarget(target.embed, target.lm_head)
    layers = list(model.cfg.target_layer_ids)
    prompt = torch.tensor([[3, 9, 1, 4, 4, 7, 2, 11, 5, 6]])
    p = prompt.shape[1]
    runner = make_runner(model, shared, 1, 64)
    cache = target.new_cache(1, 64)
    logits, feats = target.forward(prompt, cache, capture_layers=layers)
    bonus = logits[:, -1].argmax(-1)
    runner.observe(feats, torch.zeros(1, dtype=torch.long), torch.tensor([p]), prompt, bonus)
    draft = runner.propose(bonus)
    seq = torch.cat([prompt, bonus.view(1, 1), draft.tokens], dim=1)  # anchor at position p
    _, feats_all = target.full_forward(seq, capture_layers=layers)
    with torch.no_grad():
        if kind == "eagle":
            out = model.train_forward(shared, feats_all, seq, torch.tensor([p]), torch.tensor([seq.shape[1] - 1]))
            # step j of the chain anchored at p sits at position p + j - 2
            idx = torch.arange(gamma) + p - 1
            train_tokens = shared.logits(out["hidden"][0, torch.arange(gamma), idx]).argmax(-1)
            train_conf = out["confidence"][0, torch.arange(gamma), idx]
            assert bool(out["mask"][0, torch.arange(gamma), idx].all())
        else:
            out = model.train_forward(shared, feats_all, seq, torch.tensor([[p]]))
            train_tokens = out["logits"][0, 0].argmax(-1)
            train_conf = out["confidence"][0, 0]
            assert torch.equal(out["labels"][0, 0], draft.tokens[0])
    assert torch.equal(train_tokens, draft.tokens[0])
    assert torch.allclose(train_conf.double(), draft.confidence_logits[0].double(), atol=1e-6)


def test_training_reduces_loss_and_learns_a_deterministic_continuation() -> None:
    """On text where token t+1 = (t * 5 + 3) mod V the drafter's accuracy rises well above chance."""
    from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, train_drafter

    target = random_target(32, seed=2, dtype=torch.float32)
    seqs = []
    g = torch.Generator().manual_seed(0)
    for _ in range(32):
        x = [int(torch.randint(0, 32, (1,), generator=g))]
        for _ in range(40):
            x.append((x[-1] * 5 + 3) % 32)
        seqs.append((x, 8))
    for kind, floor in (("dspark", 0.4), ("eagle", 0.9)):
        torch.manual_seed(0)
        model = build_drafter(drafter_for(target, kind, gamma=3).cfg).float()
        hist = train_drafter(target, model, seqs, TrainConfig(steps=40, batch_size=8, anchors_per_seq=8, lr=1e-2,
                                                              warmup=5, log_every=39))
        assert hist[-1]["ce"] < 0.6 * hist[0]["ce"], (kind, hist)
        assert hist[-1]["acc_k1"] > floor > hist[0]["acc_k1"], (kind, hist)
    assert parameter_count(drafter_for(target, "dspark", 3)) > 0


def test_block_config_validation() -> None:
    base = dict(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=8, block_size=3, target_layer_ids=(0,), mask_token_id=1)
    with pytest.raises(ValueError, match="markov_rank"):
        DrafterConfig(kind="dspark", **base)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig(kind="dflash", **{**base, "mask_token_id": 10})
    with pytest.raises(ValueError, match="kind"):
        DrafterConfig(kind="medusa", **base)
    cfg = DrafterConfig(kind="dspark", markov_rank=4, markov_head_type="rnn", **base)
    assert DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert build_drafter(cfg).markov_head.__class__.__name__ == "RNNHead"


def test_temperature_scaling_recovers_a_known_temperature_and_lowers_ece() -> None:
    g = torch.Generator().manual_seed(0)
    true_logit = torch.randn(20000, generator=g) * 2
    outcome = (torch.rand(20000, generator=g) < torch.sigmoid(true_logit)).float()
    overconfident = true_logit * 3.0  # a head whose logits are 3x too sharp
    t = fit_temperature(overconfident, outcome)
    assert 2.7 < t < 3.3
    before = ece(torch.sigmoid(overconfident), outcome)
    after = ece(calibrated(overconfident, [t]), outcome)
    assert after < 0.02 < before
    temps = fit_position_temperatures(torch.stack([overconfident, true_logit], 1), torch.stack([outcome, outcome], 1),
                                      torch.ones(20000, 2, dtype=torch.bool))
    assert 2.7 < temps[0] < 3.3 and 0.9 < temps[1] < 1.1


def test_sharegpt_reader_survives_truncation(tmp_path: Path) -> None:
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} ?"},
                                              {"from": "gpt", "value": "answer"}]} for i in range(50)]
    text = json.dumps(convs, indent=2)
    cut = text[: int(len(text) * 0.7)]  # truncated mid-conversation, like the packaged file
    f = tmp_path / "sg.json"
    f.write_text(cut)
    got = list(iter_conversations(f, chunk_chars=256))
    assert 30 <= len(got) < 50
    assert [c["id"] for c in got] == [str(i) for i in range(len(got))]
    assert list(first_user_prompts(limit=3, path=f)) == [f"question number {i} ?" for i in range(3)]
    f.write_text(text)  # complete file
    assert len(list(iter_conversations(f, chunk_chars=300))) == 50


def test_new_modules_import_without_sglang() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import kllm_plugins.plugins.dspark.core.drafters, kllm_plugins.plugins.dspark.core.spec_loop\n"
        "import kllm_plugins.plugins.dspark.core.draft_runtime, kllm_plugins.plugins.dspark.core.calibration\n"
        "import kllm_plugins.plugins.dspark.train, kllm_plugins.plugins.dspark.training.export\n"
        "import kllm_plugins.plugins.dspark.training.dist_loss, kllm_plugins.plugins.dspark.training.walk_eval\n"
        "assert not any(m.startswith('sglang') and sys.modules[m] is not None for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
