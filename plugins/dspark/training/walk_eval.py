"""Layer: plugin tooling (no SGLang import). Greedy accept length without running the loop.

With greedy verification the loop's output is the target's own greedy answer, so every verify
step sits at a position of that (known) answer: the drafter's accepted count at anchor a depends
only on the answer's prefix up to a. `anchor_accepts` computes it for every anchor of a stored
answer in one teacher-forced forward (the training forward reproduces what the drafter drafts at
inference: tests/unit/test_dspark_drafters.py), and `walk` follows the loop's anchors
(a -> a + accepted + 1, from the first answer token, until `max_new` tokens or the answer's end).
The result equals the loop's greedy accept lengths up to floating-point rounding
(tests/unit/test_dspark_walk_eval.py checks it against `speculative_generate` in float64), at a
fraction of the cost: it is what the trainer evaluates on the validation split for learning
curves and early stopping.

Under sampling (temperature 1) there is no single text to walk: `expected_accept_length` is the
validation measure of drafters trained for sampling. Along a stored answer (sampled from the
target at temperature 1) and teacher-forced on it, the drafter's step k at anchor a is accepted
with probability alpha_k = 1 - TV(p_target, q_draft) given steps < k accepted, so a verify step
there yields 1 + sum_k prod_{j<=k} alpha_j tokens in expectation; the measure is its mean over
anchors. A proxy of the loop's temperature-1 accept length, not equal to it: the loop's drafts
after an acceptance are the drafter's own draws, not the stored text, and the loop visits anchors
by its own accepted runs rather than uniformly.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from kllm_plugins.plugins.dspark.core.drafters import BlockDrafter, EagleDrafter, SharedTarget
from kllm_plugins.plugins.dspark.training.dist_loss import reach_probability, tv_distance


@torch.no_grad()
def anchor_accepts(drafter: nn.Module, shared: SharedTarget, feats: torch.Tensor, tokens: torch.Tensor,
                   plen: torch.Tensor, lens: torch.Tensor, max_new: int) -> torch.Tensor:
    """[B, N] drafts accepted (greedy) at anchors plen + i, i < N = max_new (-1 past the answer)."""
    b, t = tokens.shape
    g = drafter.gamma  # type: ignore[attr-defined]
    dev = tokens.device
    n = max_new
    idx = plen.unsqueeze(1) + torch.arange(n, device=dev).unsqueeze(0)          # anchors [B, N]
    anchor_ok = idx <= (lens - 1).unsqueeze(1)
    if isinstance(drafter, EagleDrafter):
        out = drafter.train_forward(shared, feats, tokens, plen, lens - 1)
        hits = []
        for j in range(1, g + 1):  # step j of the chain anchored at a sits at p = a + j - 2, predicts x[a + j]
            pred = shared.logits(out["hidden"][:, j - 1]).argmax(-1)             # [B, T]
            p = (idx + j - 2).clamp(0, t - 1)
            ok = out["mask"][:, j - 1].gather(1, p) & anchor_ok & (idx + j - 2 >= 0)
            hits.append(ok & (pred.gather(1, p) == out["labels"][:, j - 1].gather(1, p)))
        hit = torch.stack(hits, dim=-1)
    else:
        assert isinstance(drafter, BlockDrafter)
        pad = g + 1  # room for the last anchors' blocks; labels past the answer never count
        tokens_p = torch.cat([tokens, tokens.new_zeros(b, pad)], dim=1)
        feats_p = torch.cat([feats, feats.new_zeros(b, pad, feats.shape[-1])], dim=1)
        anchors = torch.minimum(idx, (lens - 1).unsqueeze(1))
        out = drafter.train_forward(shared, feats_p, tokens_p, anchors)
        label_pos = anchors.unsqueeze(-1) + torch.arange(1, g + 1, device=dev)
        hit = (out["logits"].argmax(-1) == out["labels"]) & (label_pos < lens.view(b, 1, 1)) & anchor_ok.unsqueeze(-1)
    acc = hit.long().cumprod(dim=-1).sum(dim=-1)
    return torch.where(anchor_ok, acc, torch.full_like(acc, -1))


def walk(accepts: Sequence[int], answer_len: int, max_new: int) -> list[int]:
    """The loop's accept lengths (accepted + 1 per step) over one answer of `answer_len` tokens."""
    steps: list[int] = []
    a, generated = 0, 1  # the prefill's token is the first answer token and the first anchor
    while generated < max_new and a < answer_len - 1:
        m = int(accepts[a])
        steps.append(m + 1)
        generated += m + 1
        a += m + 1
    return steps


@torch.no_grad()
def walk_accept_lengths(drafter: nn.Module, shared: SharedTarget, batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                        max_new: int = 128) -> list[int]:
    """Accept lengths of every greedy verify step over all sequences of `batches`
    (tokens, prompt lengths, lengths, features, as `FeatureCache.batch` returns them)."""
    out: list[int] = []
    for tokens, plen, lens, feats in batches:
        acc = anchor_accepts(drafter, shared, feats, tokens, plen, lens, max_new).cpu()
        for row, (p, n) in enumerate(zip(plen.tolist(), lens.tolist())):
            out.extend(walk(acc[row].tolist(), n - p, max_new))
    return out


@torch.no_grad()
def expected_accepts(drafter: nn.Module, shared: SharedTarget, feats: torch.Tensor, tokens: torch.Tensor,
                     plen: torch.Tensor, lens: torch.Tensor, final: torch.Tensor, max_anchors: int = 64,
                     stride: int = 2) -> tuple[float, int]:
    """(sum over anchors of the expected accepted drafts at temperature 1, number of anchors).

    Block drafters: anchors plen + stride * i (i < max_anchors) with a whole block inside the
    answer; EAGLE-style: every chain its training forward trains (anchors in the answer).
    `final` [B,T,H]: the target's normed final hidden states (`FeatureCache.final_batch`).
    """
    b, t = tokens.shape
    dev = tokens.device
    if isinstance(drafter, EagleDrafter):
        out = drafter.train_forward(shared, feats, tokens, plen, lens - 1)
        mask = out["mask"]
        nxt = torch.arange(t, device=dev).add(1).clamp(max=t - 1)
        g = mask.shape[1]
        tgt = final[:, nxt].unsqueeze(1).expand(b, g, t, final.shape[-1])
        alpha = torch.zeros(mask.shape, device=dev, dtype=torch.float32)
        alpha[mask] = (1.0 - tv_distance(shared.logits(tgt[mask]), shared.logits(out["hidden"][mask]))).clamp(0.0, 1.0)
        r = torch.zeros_like(alpha)
        r[:, 0] = mask[:, 0].float()
        for j in range(1, g):
            r[:, j, 1:] = r[:, j - 1, :-1] * alpha[:, j - 1, :-1] * mask[:, j, 1:].float()
        return float((r * alpha).sum()), int(mask[:, 0].sum())
    assert isinstance(drafter, BlockDrafter)
    g = drafter.gamma
    idx = plen.unsqueeze(1) + stride * torch.arange(max_anchors, device=dev).unsqueeze(0)
    ok = idx <= (lens - 1 - g).unsqueeze(1)
    if not bool(ok.any()):
        return 0.0, 0
    anchors = torch.minimum(idx, (lens - 1 - g).clamp_min(0).unsqueeze(1))
    out = drafter.train_forward(shared, feats, tokens, anchors)
    pos = (anchors.unsqueeze(-1) + torch.arange(g, device=dev)).reshape(b, -1, 1)
    h = final.gather(1, pos.expand(b, pos.shape[1], final.shape[-1])).view(b, anchors.shape[1], g, -1)
    alpha = (1.0 - tv_distance(shared.logits(h), out["logits"])).clamp(0.0, 1.0)
    per_anchor = (reach_probability(alpha) * alpha).sum(-1)
    return float(per_anchor[ok].sum()), int(ok.sum())


def expected_accept_length(drafter: nn.Module, shared: SharedTarget,
                           batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                           max_anchors: int = 64) -> float:
    """1 + the mean expected accepted drafts at temperature 1 over the anchors of `batches`
    (tokens, prompt lengths, lengths, features, final hidden states)."""
    total, count = 0.0, 0
    for tokens, plen, lens, feats, final in batches:
        s, n = expected_accepts(drafter, shared, feats, tokens, plen, lens, final, max_anchors)
        total, count = total + s, count + n
    return 1.0 + total / max(1, count)
