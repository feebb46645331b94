"""Layer: plugin tooling (no SGLang import). The distribution-matching loss for sampling drafters.

Under sampling verification (temperature 1: draft x ~ q, accepted with min(1, p(x)/q(x))) a
drafted position is accepted with probability sum_x min(p, q) = 1 - TV(p, q), TV = 1/2 ||p - q||_1,
given that the positions before it were. So a drafter meant for sampling is trained towards the
target's whole distribution, not only its argmax: per drafted position
    w_ce * CE(target token) + w_tv * TV(p_target, q_draft),
weighted over positions by w_k = exp(-k / decay) as the CE loss (DeepSpec: w_ce 0.1, w_tv 0.9,
p_target at temperature 1, answers sampled at temperature 0.7). p_target comes from the target's
final hidden state (`FeatureCache(final_hidden=True)`) through its lm_head.

The confidence head's target becomes the acceptance probability itself, 1 - TV (DeepSpec's
1 - 1/2 ||p_d - p_t||_1), and each position counts with the probability that a verifier reaches
it, prod_{j<k} (1 - TV_j) (the sampling counterpart of `trainer.reached`), both detached: the
confidence head learns P(position k accepted | positions < k accepted), what the planner reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def tv_distance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """1/2 ||softmax(target) - softmax(draft)||_1 over the last dim (fp32), differentiable in the draft."""
    p = torch.softmax(target_logits.float(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    return 0.5 * (p - q).abs().sum(-1)


def reach_probability(alpha: torch.Tensor) -> torch.Tensor:
    """[..., gamma]: probability that a verifier reaches step k, prod_{j<k} alpha_j (1 at step 0)."""
    ones = torch.ones_like(alpha[..., :1])
    return torch.cat([ones, alpha[..., :-1]], dim=-1).cumprod(dim=-1)


def position_weights(g: int, decay: float, device: torch.device) -> torch.Tensor:
    return torch.exp(-torch.arange(g, device=device, dtype=torch.float32) / decay)


def block_dist_losses(out: dict[str, torch.Tensor], target_logits: torch.Tensor, decay: float, w_ce: float,
                      w_tv: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Block drafters: `out` from `BlockDrafter.train_forward` ([B,N,g,V] logits, [B,N,g] labels and
    confidence logits); `target_logits` [B,N,g,V] the target's logits for the same positions."""
    logits, labels, conf = out["logits"], out["labels"], out["confidence"]
    g = labels.shape[-1]
    w = position_weights(g, decay, labels.device)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    tv = tv_distance(target_logits, logits)
    denom = w.sum() * labels[..., 0].numel()
    ce_loss, tv_loss = (ce * w).sum() / denom, (tv * w).sum() / denom
    alpha = (1.0 - tv).detach().clamp(0.0, 1.0)
    r = reach_probability(alpha)
    bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
    conf_loss = (bce * r).sum() / r.sum().clamp_min(1e-6)
    hit = (logits.argmax(-1) == labels).float()
    info = {"ce": ce_loss.detach(), "tv": tv_loss.detach(), "acc_k1": hit[..., 0].mean(), "acc_mean": hit.mean(),
            "p_accept_k1": alpha[..., 0].mean(), "accept_len_t1_tf": 1 + (r[..., 1:].sum(-1) + r[..., -1] * alpha[..., -1]).mean()}
    return w_ce * ce_loss + w_tv * tv_loss, conf_loss, info


def eagle_dist_losses(shared_logits, out: dict[str, torch.Tensor], target_final: torch.Tensor, decay: float,  # noqa: ANN001
                      w_ce: float, w_tv: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-style: `out` from `EagleDrafter.train_forward` (hidden [B,g,T,H], labels/mask/confidence
    [B,g,T]; step j at position p predicts x[p + 2]); `target_final` [B,T,H] the target's normed final
    hidden states (the target's distribution of x[p + 2] is read at p + 1); `shared_logits` maps
    hidden states to logits through the shared lm_head."""
    hidden, labels, mask, conf = out["hidden"], out["labels"], out["mask"], out["confidence"]
    b, g, t = labels.shape
    w = position_weights(g, decay, labels.device).view(1, g, 1).expand_as(mask)
    nxt = torch.arange(t, device=labels.device).add(1).clamp(max=t - 1)
    tgt = target_final[:, nxt].unsqueeze(1).expand(b, g, t, target_final.shape[-1])
    sel_w = w[mask]
    logits = shared_logits(hidden[mask])
    ce = F.cross_entropy(logits, labels[mask], reduction="none")
    tv = tv_distance(shared_logits(tgt[mask]), logits)
    denom = sel_w.sum().clamp_min(1e-6)
    ce_loss, tv_loss = (ce * sel_w).sum() / denom, (tv * sel_w).sum() / denom
    alpha = torch.zeros(mask.shape, device=labels.device, dtype=torch.float32)
    alpha[mask] = (1.0 - tv).detach().clamp(0.0, 1.0)
    # chain reach: step j at p continues step j-1 at p - 1
    r = torch.zeros_like(alpha)
    r[:, 0] = mask[:, 0].float()
    for j in range(1, g):
        r[:, j, 1:] = r[:, j - 1, :-1] * alpha[:, j - 1, :-1] * mask[:, j, 1:].float()
    bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
    conf_loss = (bce * r).sum() / r.sum().clamp_min(1e-6)
    hit = logits.argmax(-1) == labels[mask]
    step1 = mask[:, 0]
    info = {"ce": ce_loss.detach(), "tv": tv_loss.detach(), "acc_mean": hit.float().mean(),
            "acc_k1": (hit.new_zeros(mask.shape).masked_scatter(mask, hit)[:, 0] & step1).sum() / step1.sum().clamp_min(1),
            "p_accept_k1": (alpha[:, 0] * step1).sum() / step1.sum().clamp_min(1)}
    return w_ce * ce_loss + w_tv * tv_loss, conf_loss, info
