"""Drafter training pieces added for the GPU evaluation: the tied Markov head exports an equivalent
untied (SGLang-format) head, the feature cache reproduces the target's features, per-position
temperature + bias calibration, the "reached" mask of the confidence loss, time-limited training."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kllm_plugins.plugins.dspark.core.calibration import calibrated_platt, ece, fit_platt
from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, build_drafter, parameter_count
from kllm_plugins.plugins.dspark.training.data import pad_batch
from kllm_plugins.plugins.dspark.training.export import load_drafter, write_checkpoint
from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, reached, train_drafter

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import drafter_for, random_target  # noqa: E402


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_tied_markov_head_exports_an_equivalent_untied_head(head: str, tmp_path: Path) -> None:
    target = random_target(64, seed=3)
    base = drafter_for(target, "dspark", gamma=4, head=head, layers=(0,))  # the ids SGLang can capture
    torch.manual_seed(5)
    tied = build_drafter(replace(base.cfg, markov_tied=True)).to(torch.float64).eval()
    with torch.no_grad():  # a head with weight, so drafts depend on the previous token
        tied.markov_head.markov_q.weight.normal_(0, 1.0)
    assert parameter_count(tied) < parameter_count(build_drafter(base.cfg))  # 2*H*r instead of 2*V*r
    shared = SharedTarget(target.embed, target.lm_head)
    write_checkpoint(tied, tmp_path, num_target_layers=target.shape.num_layers, dtype=torch.float32, shared=shared)
    untied = load_drafter(tmp_path).to(torch.float64).eval()
    assert not untied.cfg.markov_tied and type(untied.markov_head).__name__ != "TiedMarkovHead"
    layers = list(base.cfg.target_layer_ids)
    prompt = torch.tensor([[3, 9, 1, 4, 4, 7, 2, 11, 5, 6], [8, 8, 2, 30, 41, 5, 6, 7, 1, 9]])
    outs = []
    for model in (tied, untied):
        runner = make_runner(model, shared, 2, 64)
        cache = target.new_cache(2, 64)
        logits, feats = target.forward(prompt, cache, capture_layers=layers)
        bonus = logits[:, -1].argmax(-1)
        runner.observe(feats, torch.zeros(2, dtype=torch.long), torch.tensor([10, 10]), prompt, bonus)
        outs.append(runner.propose(bonus))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.allclose(outs[0].confidence_logits, outs[1].confidence_logits, atol=1e-4)
    # the Markov correction matters: without it the drafts differ somewhere
    with torch.no_grad():
        tied.markov_head.markov_q.weight.zero_()
    runner = make_runner(tied, shared, 2, 64)
    cache = target.new_cache(2, 64)
    logits, feats = target.forward(prompt, cache, capture_layers=layers)
    runner.observe(feats, torch.zeros(2, dtype=torch.long), torch.tensor([10, 10]), prompt, logits[:, -1].argmax(-1))
    assert not torch.equal(runner.propose(logits[:, -1].argmax(-1)).tokens, outs[0].tokens)


def test_feature_cache_reproduces_the_targets_features() -> None:
    target = random_target(50, seed=4)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 50, (int(n),), generator=g).tolist(), 3) for n in (12, 5, 20, 9, 16, 7)]
    layers = [0, 1]
    cache = FeatureCache(target, seqs, layers, max_batch_tokens=40)  # several forward batches
    for index in ([0, 1, 2], [5, 3], [2, 2, 4, 0]):
        tokens, plen, lens, feats = cache.batch(index)
        ref_tokens, ref_plen, ref_lens = pad_batch([seqs[i] for i in index], 0, target.device)
        _, ref_feats = target.full_forward(ref_tokens, capture_layers=layers, want_logits=False)
        assert torch.equal(tokens, ref_tokens) and torch.equal(plen, ref_plen) and torch.equal(lens, ref_lens)
        for row, n in enumerate(lens.tolist()):
            assert torch.allclose(feats[row, :n], ref_feats[row, :n], atol=1e-9)
            assert not feats[row, n:].any()


def test_temperature_plus_bias_recovers_a_biased_head() -> None:
    g = torch.Generator().manual_seed(0)
    true_logit = torch.randn(40000, generator=g) * 1.5
    outcome = (torch.rand(40000, generator=g) < torch.sigmoid(true_logit)).float()
    skewed = (true_logit + 1.2) * 2.0  # over-confident and biased towards acceptance
    t, b = fit_platt(skewed, outcome)
    assert 1.8 < t < 2.2 and -1.35 < b < -1.05
    after = ece(calibrated_platt(skewed, [t], [b]), outcome)
    assert after < 0.015 < ece(torch.sigmoid(skewed), outcome)


def test_reached_marks_steps_after_an_unbroken_run() -> None:
    hit = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert reached(hit).tolist() == [[True, True, True, False], [True, False, False, False], [True, True, True, True]]


def test_training_stops_at_its_time_limit_with_the_cache_reused() -> None:
    target = random_target(32, seed=2, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 32, (30,), generator=g).tolist(), 4) for _ in range(8)]
    model = build_drafter(drafter_for(target, "dflash", gamma=3).cfg).float()
    cache = FeatureCache(target, seqs, list(model.cfg.target_layer_ids))
    hist = train_drafter(target, model, seqs, TrainConfig(steps=10**7, batch_size=2, anchors_per_seq=2,
                                                          time_limit_s=0.5, log_every=10**6), cache=cache)
    assert hist[-1].get("stopped_by_time_limit") == 1.0 and hist[-1]["step"] < 10**7
    with pytest.raises(ValueError, match="other sequences"):
        train_drafter(target, model, seqs[:4], TrainConfig(steps=1), cache=cache)
