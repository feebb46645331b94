"""EAGLE-style training-time test runs its steps 2..gamma over answer positions only.

Multi-turn prompts put about half of the training tokens in prompts, where no chain is trained;
running the unrolled steps there only costs the EAGLE-style drafter steps at equal wall time.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, parameter_count

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import drafter_for, random_target  # noqa: E402


def _batch(target, lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    t = max(lens)
    tokens = torch.randint(0, target.shape.vocab_size, (len(lens), t), generator=g)
    for row, n in enumerate(lens):
        tokens[row, n:] = 0
    _, feats = target.full_forward(tokens, capture_layers=list(range(target.shape.num_layers)))
    return tokens, feats


def test_eagle_chains_are_the_same_whatever_prompt_positions_are_skipped() -> None:
    """Every trained chain (anchor >= prompt length) gets the same hidden states and confidences
    as when the forward also runs every prompt position (valid_from = 0)."""
    target = random_target(32, seed=3)
    model = drafter_for(target, "eagle", gamma=5, seed=2)
    shared = SharedTarget(target.embed, target.lm_head)
    lens = [40, 33, 26]
    tokens, feats = _batch(target, lens, seed=4)
    plen = torch.tensor([30, 12, 3])
    valid_to = torch.tensor(lens) - 1
    with torch.no_grad():
        part = model.train_forward(shared, feats, tokens, plen, valid_to)
        full = model.train_forward(shared, feats, tokens, torch.zeros(3, dtype=torch.long), valid_to)
    m = part["mask"]
    assert int(m.sum()) > 0 and bool((m <= full["mask"]).all())
    assert torch.allclose(part["hidden"][m], full["hidden"][m], atol=1e-9)
    assert torch.allclose(part["confidence"][m], full["confidence"][m], atol=1e-9)
    assert torch.equal(part["labels"][m], full["labels"][m])
    # anchors (a = p - j + 2) exactly in [plen, valid_to - j] per row
    b, g, t = m.shape
    js = torch.arange(1, g + 1).view(1, g, 1)
    a = torch.arange(t).view(1, 1, t) - js + 2
    assert torch.equal(m, (a >= plen.view(b, 1, 1)) & (a + js <= valid_to.view(b, 1, 1)))


def test_eagle_unrolled_steps_skip_prompt_positions() -> None:
    """Query rows the layers process: step 1 all T positions, steps 2..gamma only each row's
    answer window (the longest one in the batch), not T again per step."""
    target = random_target(32, seed=5)
    gamma = 6
    model = drafter_for(target, "eagle", gamma=gamma, seed=1)
    shared = SharedTarget(target.embed, target.lm_head)
    lens = [60, 58]
    plen = torch.tensor([45, 40])
    tokens, feats = _batch(target, lens, seed=6)
    rows: list[int] = []
    hook = model.layers[0].self_attn.q_proj.register_forward_hook(lambda _m, inp, _o: rows.append(inp[0].shape[1]))
    params_before = parameter_count(model)
    with torch.no_grad():
        model.train_forward(shared, feats, tokens, plen, torch.tensor(lens) - 1)
    hook.remove()
    t = max(lens)
    window = max(n - 1 - p - 1 for n, p in zip(lens, plen.tolist()))  # positions p in [plen, len - 3]
    assert rows == [t] + [window] * (gamma - 1)
    assert sum(rows) < 0.45 * gamma * t  # the unrolled steps no longer scale with the prompt
    assert parameter_count(model) == params_before


def test_eagle_training_step_backpropagates_through_the_window() -> None:
    """The loss on answer chains reaches every layer (the windowed steps are not detached)."""
    from kllm_plugins.plugins.dspark.training.trainer import eagle_losses

    target = random_target(32, seed=8, dtype=torch.float32)
    model = drafter_for(target, "eagle", gamma=4, seed=3).float().train()
    shared = SharedTarget(target.embed, target.lm_head)
    lens = [30, 24]
    tokens, feats = _batch(target, lens, seed=9)
    out = model.train_forward(shared, feats, tokens, torch.tensor([20, 10]), torch.tensor(lens) - 1)
    ce, conf, _ = eagle_losses(shared, out, 4.0)
    (ce + conf).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
