"""Layer: plugin core (torch only, no SGLang import). DSpark's Markov heads and confidence head.

Same structure and parameter names as SGLang 0.5.23 (`srt/models/dspark.py`): the Markov head
adds to step k's base logits a bias computed from the token drafted at step k-1 (the anchor
for k = 0):
- vanilla: bias = W2 W1[x]                                  (`markov_w1` Embedding, `markov_w2` Linear)
- gated:   bias = W2 (sigmoid(G [h; W1[x]]) * W1[x])         (+ `gate_proj`)
- rnn:     s' = g*s + (1-g)*tanh(c), bias = W2 tanh(o), [g,c,o] = J [s; W1[x]; h]   (+ `joint_proj`)
The confidence head is `proj([h; W1[x_prev]]) -> 1` (a logit; SGLang applies sigmoid(logit / T_k)).
"""
from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class VanillaMarkov(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov rank must be > 0, got {rank}")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as "no correction": the base drafter

    def prev_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(tokens.long())

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None

    def step_bias(self, prev: torch.Tensor, hidden: torch.Tensor,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.markov_w2(self.prev_embed(prev).to(hidden.dtype)), state


class GatedMarkovHead(VanillaMarkov):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step_bias(self, prev: torch.Tensor, hidden: torch.Tensor,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self.prev_embed(prev).to(hidden.dtype)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1)))
        return self.markov_w2(gate * e), state


class RNNHead(VanillaMarkov):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return hidden.new_zeros(*hidden.shape[:-2], self.rank) if hidden.dim() > 2 else hidden.new_zeros(hidden.shape[0], self.rank)

    def step_bias(self, prev: torch.Tensor, hidden: torch.Tensor,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self.prev_embed(prev).to(hidden.dtype)
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        g, c, o = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        new_state = g * state + (1.0 - g) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), new_state


def build_markov_head(kind: str, vocab_size: int, rank: int, hidden_size: int) -> VanillaMarkov:
    if kind == "vanilla":
        return VanillaMarkov(vocab_size, rank)
    if kind == "gated":
        return GatedMarkovHead(vocab_size, rank, hidden_size)
    if kind == "rnn":
        return RNNHead(vocab_size, rank, hidden_size)
    raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {kind!r}")


class ConfidenceHead(nn.Module):
    """Logit of P(draft k accepted | drafts < k accepted), from [h_k ; W1[x_{k-1}]] (or h_k alone)."""

    def __init__(self, hidden_size: int, markov_rank: int = 0) -> None:
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor | None = None) -> torch.Tensor:
        feats = hidden if not self.with_markov else torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1)
        return self.proj(feats.to(self.proj.weight.dtype)).squeeze(-1)


class TiedMarkovHead(nn.Module):
    """A Markov head factorised through the target's (frozen) embedding E and lm_head LM.

    Training-time parametrisation of the heads above: W1[x] = P E[x] (P: hidden -> rank) and
    W2 = LM Q (Q: rank -> hidden), so the head's bias W2 u equals LM (Q u), a shift of the hidden
    state before the shared lm_head. Trainable parameters: 2 * hidden * rank (+ the gate/joint
    projection) instead of 2 * vocab * rank, which leaves the parameter budget to the drafter's
    layers. `materialize` writes SGLang's `markov_w1`/`markov_w2` (products with E and LM), so the
    exported checkpoint is an ordinary head of `kind` and loads unchanged.
    """

    def __init__(self, kind: str, rank: int, hidden_size: int) -> None:
        super().__init__()
        if kind not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {kind!r}")
        if rank <= 0:
            raise ValueError(f"markov rank must be > 0, got {rank}")
        self.kind, self.rank = kind, rank
        self.markov_p = nn.Linear(hidden_size, rank, bias=False)
        self.markov_q = nn.Linear(rank, hidden_size, bias=False)
        nn.init.normal_(self.markov_p.weight, std=hidden_size ** -0.5)
        nn.init.zeros_(self.markov_q.weight)  # starts as "no correction": the base drafter
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embed(self, tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """u = P E[x]: what SGLang's `markov_w1[x]` returns for the materialised head."""
        e = nn.functional.embedding(tokens.long(), embed).to(self.markov_p.weight.dtype)
        return self.markov_p(e)

    def step_shift(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None,
                   embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden-space shift Q z, new state); the logit bias is LM @ shift."""
        u = self.prev_embed(prev, embed).to(hidden.dtype)
        if self.kind == "vanilla":
            return self.markov_q(u), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, u], dim=-1)))
            return self.markov_q(gate * u), state
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        g, c, o = self.joint_proj(torch.cat([state.to(hidden.dtype), u, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        new_state = g * state + (1.0 - g) * torch.tanh(c)
        return self.markov_q(torch.tanh(o)), new_state

    @torch.no_grad()
    def materialize(self, embed: torch.Tensor, lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
        """State dict of the equivalent untied head (SGLang's names, fp32)."""
        out = {"markov_w1.weight": embed.float() @ self.markov_p.weight.float().T,
               "markov_w2.weight": lm_head.float() @ self.markov_q.weight.float()}
        for name, t in self.state_dict().items():
            if not name.startswith(("markov_p.", "markov_q.")):
                out[name] = t.float()
        return out
