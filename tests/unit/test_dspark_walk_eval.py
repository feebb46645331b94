"""The learning-curve measure: the greedy walk over the target's answer reproduces the loop's
accept lengths step for step; evaluations during training keep the best weights."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget
from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate, speculative_generate
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, train_drafter
from kllm_plugins.plugins.dspark.training.walk_eval import anchor_accepts, walk

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import drafter_for, random_target  # noqa: E402


def test_walk_follows_accepted_runs() -> None:
    # accepts at answer positions 0..: step at 0 accepts 2 -> next anchor 3, accepts 0 -> 4, ...
    acc = [2, 9, 9, 0, 3, 9, 9, 9, 1, 9, 9]
    assert walk(acc, answer_len=20, max_new=11) == [3, 1, 4, 2]      # 1 + 3 + 1 + 4 + 2 = 11 tokens
    assert walk(acc, answer_len=5, max_new=100) == [3, 1]           # the answer's last token reached
    assert walk(acc, answer_len=20, max_new=1) == []                # the prefill's token is all


@pytest.mark.parametrize("kind,head", [("dspark", "vanilla"), ("dspark", "rnn"), ("dflash", "vanilla"),
                                       ("eagle", "vanilla")])
def test_walk_equals_the_loops_greedy_accept_lengths(kind: str, head: str) -> None:
    vocab, gamma, max_new = 6, 3, 20  # a small vocabulary: random drafts are often right
    target = random_target(vocab, seed=11)
    model = drafter_for(target, kind, gamma=gamma, head=head, seed=3)
    shared = SharedTarget(target.embed, target.lm_head)
    layers = list(model.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 7, 9, 6)]
    accepted_any = 0
    for prompt in prompts:
        loop = speculative_generate(target, lambda b, m: make_runner(model, shared, b, m), [prompt], gamma=gamma,
                                    max_new_tokens=max_new, capture_layers=layers)
        ref = autoregressive_generate(target, [prompt], max_new_tokens=max_new + gamma + 2).outputs[0]
        seq = torch.tensor([prompt + ref])
        _, feats = target.full_forward(seq, capture_layers=layers)
        acc = anchor_accepts(model, shared, feats, seq, torch.tensor([len(prompt)]), torch.tensor([seq.shape[1]]),
                             max_new)[0].tolist()
        steps = walk(acc, len(ref), max_new)
        assert steps == loop.accept_lengths().long().tolist()
        accepted_any += sum(s > 1 for s in steps)
    assert accepted_any >= 3  # the comparison covers accepted runs, not only rejections


def test_training_evaluates_off_the_clock_and_keeps_the_best_weights() -> None:
    target = random_target(16, seed=2, dtype=torch.float32)
    model = drafter_for(target, "dflash", gamma=3).float()
    seqs = [([int(x) for x in torch.randint(0, 16, (30,), generator=torch.Generator().manual_seed(i))], 6)
            for i in range(8)]
    scores = iter([1.0, 3.0, 2.0, 0.5])
    seen: list[torch.Tensor] = []

    def evaluate(m: torch.nn.Module) -> float:
        seen.append(m.fc.weight.detach().clone())
        return next(scores)

    curve: list[dict[str, float]] = []
    train_drafter(target, model, seqs, TrainConfig(steps=40, batch_size=4, anchors_per_seq=4, lr=1e-2, warmup=2,
                                                   log_every=100, eval_at=(0.25, 0.5, 0.75, 1.0)),
                  evaluate=evaluate, curve=curve)
    assert [c["progress"] for c in curve] == [0.25, 0.5, 0.75, 1.0]
    assert [c["step"] for c in curve] == [10, 20, 30, 40]
    assert not torch.equal(seen[1], seen[3])  # training moved the weights after the best point
    assert torch.equal(model.fc.weight, seen[1])  # ... and the best point's weights came back
    with pytest.raises(ValueError, match="eval_at"):
        TrainConfig(eval_at=(0.5, 0.25))
