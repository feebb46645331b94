"""Layer: ring_cp core (plain torch, no SGLang import). Online-softmax merge of partial attention.

A partial result over a subset of keys is (out, lse): the softmax-weighted values over that
subset and the log-sum-exp of its scaled scores. Two partials over disjoint key sets combine
exactly: lse = logaddexp(lse_a, lse_b), out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
Rows that have seen no key yet carry lse = -inf and out = 0.
"""
from __future__ import annotations

import torch


class PartialAttention:
    """Running (out, lse) for a set of query rows; fp32 whatever the input dtype."""

    def __init__(self, rows: int, heads: int, head_dim: int, device: torch.device | str) -> None:
        self.out = torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=device)
        self.lse = torch.full((rows, heads), float("-inf"), dtype=torch.float32, device=device)

    def merge(self, lo: int, hi: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold a partial for rows [lo, hi) into the running state."""
        merge_into(self.out[lo:hi], self.lse[lo:hi], out, lse)

    def merge_rows(self, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold a partial for the given row indices."""
        o, l = self.out[rows], self.lse[rows]
        merge_into(o, l, out, lse)
        self.out[rows] = o
        self.lse[rows] = l

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out.to(dtype), self.lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse))."""
    lse = lse.float()
    new = torch.logaddexp(acc_lse, lse)
    # Where both sides are empty, keep the state empty instead of producing NaN.
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(acc_lse - safe).unsqueeze(-1)
    wb = torch.exp(lse - safe).unsqueeze(-1)
    acc_out.mul_(wa).add_(out.float() * wb)
    acc_lse.copy_(new)
