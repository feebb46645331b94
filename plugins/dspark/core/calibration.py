"""Layer: plugin core (torch only, no SGLang import). Per-position temperature scaling of confidences.

SGLang's DSPARK computes confidence_k = sigmoid(logit_k / T_k) with one temperature per block
position (its STS file: `{"gamma", "temperatures", "ece_before", "ece_after"}`). We fit T_k by
minimising the binary NLL on a calibration split (golden-section search over log T), and report
the expected calibration error (equal-width bins, weighted by bin size).
"""
from __future__ import annotations

import math

import torch


def ece(prob: torch.Tensor, outcome: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error of probabilities `prob` for 0/1 `outcome` (flat tensors)."""
    prob = prob.flatten().double()
    outcome = outcome.flatten().double()
    if prob.numel() == 0:
        return 0.0
    idx = (prob * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        if n:
            total += n * abs(float(prob[sel].mean()) - float(outcome[sel].mean()))
    return total / prob.numel()


def _nll(logits: torch.Tensor, outcome: torch.Tensor, temperature: float) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits / temperature, outcome))


def fit_temperature(logits: torch.Tensor, outcome: torch.Tensor, lo: float = 0.05, hi: float = 20.0,
                    iters: int = 60) -> float:
    """The T minimising NLL of sigmoid(logits / T) (NLL is unimodal in log T for fixed logits)."""
    logits, outcome = logits.flatten().double(), outcome.flatten().double()
    if logits.numel() == 0:
        return 1.0
    a, b = math.log(lo), math.log(hi)
    phi = (math.sqrt(5) - 1) / 2
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = _nll(logits, outcome, math.exp(c)), _nll(logits, outcome, math.exp(d))
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = _nll(logits, outcome, math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = _nll(logits, outcome, math.exp(d))
    return math.exp((a + b) / 2)


def fit_position_temperatures(logits: torch.Tensor, outcome: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """logits/outcome/valid [N, gamma]: one temperature per position over the valid entries."""
    return [fit_temperature(logits[:, k][valid[:, k]], outcome[:, k][valid[:, k]]) for k in range(logits.shape[1])]


def calibrated(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    t = torch.tensor(temperatures, dtype=torch.float64, device=logits.device)
    return torch.sigmoid(logits.double() / t)


def fit_platt(logits: torch.Tensor, outcome: torch.Tensor, iters: int = 50) -> tuple[float, float]:
    """(T, b) minimising NLL of sigmoid(logits / T + b): temperature plus a bias (Platt scaling).

    Temperature alone keeps sigmoid(0) = 0.5 and can only sharpen or flatten; when the head is
    biased (e.g. trained on teacher-forced steps and read on the loop's steps) a bias is needed.
    Newton steps on (1/T, b) in float64, started from the temperature-only fit.
    """
    x, y = logits.flatten().double(), outcome.flatten().double()
    if x.numel() == 0:
        return 1.0, 0.0
    a, b = 1.0 / fit_temperature(x, y), 0.0
    for _ in range(iters):
        p = torch.sigmoid(a * x + b)
        g = torch.stack([((p - y) * x).sum(), (p - y).sum()])
        w = p * (1 - p)
        h = torch.stack([torch.stack([(w * x * x).sum(), (w * x).sum()]), torch.stack([(w * x).sum(), w.sum()])])
        h = h + torch.eye(2, dtype=h.dtype) * 1e-9 * float(x.numel())
        step = torch.linalg.solve(h, g)
        a, b = a - float(step[0]), b - float(step[1])
        if float(step.abs().max()) < 1e-10:
            break
    a = max(a, 1e-3)  # a non-positive slope would invert the ranking: keep the head's order
    return 1.0 / a, b


def calibrated_platt(logits: torch.Tensor, temperatures: list[float], biases: list[float]) -> torch.Tensor:
    t = torch.tensor(temperatures, dtype=torch.float64, device=logits.device)
    b = torch.tensor(biases, dtype=torch.float64, device=logits.device)
    return torch.sigmoid(logits.double() / t + b)
