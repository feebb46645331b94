"""Layer: plugin core (torch only, no SGLang import). Drafting at inference time, with ragged state.

A runner holds one drafter's per-request state for the reference speculative loop:
- `observe(feats, start, n_keep, tokens, bonus)`: the target just ran `tokens` [B,T] at positions
  start..start+T-1 and returned their features; the first `n_keep[b]` are committed and `bonus[b]`
  is the next token (the next block's anchor).
- `propose(bonus, temperature, generator)`: draft gamma tokens after each anchor; returns the
  tokens, the draft distribution of each step (None when greedy) and raw confidence logits.
Rows advance by different amounts; stale entries past a row's length are overwritten later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kllm_plugins.plugins.dspark.core.drafters import BlockDrafter, EagleDrafter, SharedTarget
from kllm_plugins.plugins.dspark.core.draft_layers import gqa_attention


@dataclass
class DraftOut:
    tokens: torch.Tensor            # [B, gamma]
    probs: torch.Tensor | None      # [B, gamma, V] draft distribution (None: greedy / one-hot)
    confidence_logits: torch.Tensor  # [B, gamma]


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1]), probs


def _scatter_positions(buf: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """buf [B,Hkv,S,D] <- values [B,Hkv,T,D] at positions [B,T]."""
    rows = torch.arange(buf.shape[0], device=buf.device).unsqueeze(1)
    if int(positions.max()) >= buf.shape[2]:
        raise ValueError("draft cache overflow")
    buf[rows, :, positions] = values.transpose(1, 2)


class _CachedRunner:
    """A drafter with its own KV cache per layer ([batch, kv heads, max_len, head dim]) and row lengths."""

    def __init__(self, drafter: BlockDrafter | EagleDrafter, shared: SharedTarget, batch: int,
                 max_len: int) -> None:
        self.shared = shared
        cfg = drafter.cfg
        p = next(drafter.parameters())
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.ck = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in drafter.layers]
        self.cv = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in drafter.layers]
        self.lens = torch.zeros(batch, dtype=torch.long, device=p.device)


class BlockDraftRunner(_CachedRunner):
    def __init__(self, drafter: BlockDrafter, shared: SharedTarget, batch: int, max_len: int) -> None:
        super().__init__(drafter, shared, batch, max_len)
        self.d = drafter

    @torch.no_grad()
    def observe(self, feats: torch.Tensor, start: torch.Tensor, n_keep: torch.Tensor, tokens: torch.Tensor,
                bonus: torch.Tensor) -> None:
        positions = start.unsqueeze(1) + torch.arange(feats.shape[1], device=feats.device)
        for i, (k, v) in enumerate(self.d.context_kv(feats, positions)):
            _scatter_positions(self.ck[i], positions, k)
            _scatter_positions(self.cv[i], positions, v)
        self.lens = start + n_keep

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> DraftOut:
        d, g = self.d, self.d.gamma
        b = bonus.shape[0]
        dev = bonus.device
        ids = d.block_inputs(self.shared, bonus)
        pos = self.lens.unsqueeze(1) + torch.arange(g, device=dev)
        s = self.ck[0].shape[2]
        ctx_mask = torch.arange(s, device=dev).view(1, 1, s) < self.lens.view(b, 1, 1)
        mask = torch.cat([ctx_mask.expand(b, g, s), torch.ones(b, g, g, dtype=torch.bool, device=dev)], dim=-1)
        embeds = self.shared.embed_tokens(ids, self.ck[0].dtype)
        hidden = d.block_hidden(embeds, pos, list(zip(self.ck, self.cv)), mask)
        if d.markov_head is None:
            tokens, probs = choose(self.shared.logits(hidden), temperature, generator)
            return DraftOut(tokens, probs, d.confidence_head(hidden))
        prev, state = bonus, None
        toks, prob_steps, prevs = [], [], []
        for k in range(g):
            prevs.append(prev)
            logits_k, state = d.markov_step(self.shared, prev, hidden[:, k], state)
            tok, pk = choose(logits_k, temperature, generator)
            toks.append(tok)
            prob_steps.append(pk)
            prev = tok
        prev_stack = torch.stack(prevs, dim=1)
        conf = d.confidence_head(hidden, d.markov_prev_embed(self.shared, prev_stack))
        probs = None if temperature <= 0 else torch.stack(prob_steps, dim=1)  # type: ignore[arg-type]
        return DraftOut(torch.stack(toks, dim=1), probs, conf)


class EagleDraftRunner(_CachedRunner):
    def __init__(self, drafter: EagleDrafter, shared: SharedTarget, batch: int, max_len: int) -> None:
        super().__init__(drafter, shared, batch, max_len)
        self.d = drafter
        self.last_hidden: torch.Tensor | None = None

    def _run(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal pass of x [B,T,H] at positions [B,T] (contiguous per row), writing the cache."""
        b, t = positions.shape
        s = self.ck[0].shape[2]
        dev = x.device
        mask = torch.arange(s, device=dev).view(1, 1, s) <= positions.unsqueeze(-1)
        for i, layer in enumerate(self.d.layers):
            h = layer.input_layernorm(x)
            q = layer.self_attn.q(h, positions)
            k, v = layer.self_attn.kv(h, positions)
            _scatter_positions(self.ck[i], positions, k)
            _scatter_positions(self.cv[i], positions, v)
            x = x + layer.self_attn.out(gqa_attention(q, self.ck[i], self.cv[i], mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.d.norm(x)

    @torch.no_grad()
    def observe(self, feats: torch.Tensor, start: torch.Tensor, n_keep: torch.Tensor, tokens: torch.Tensor,
                bonus: torch.Tensor) -> None:
        b, t = tokens.shape
        dev = tokens.device
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).clone()
        rows = torch.arange(b, device=dev)
        last = (n_keep - 1).clamp_min(0)  # n_keep = 0: a finished row, its state is unused
        nxt[rows, last] = bonus
        positions = start.unsqueeze(1) + torch.arange(t, device=dev)
        hidden = self._run(self.d.step_input(self.shared, self.d.context_feature(feats), nxt), positions)
        self.last_hidden = hidden[rows, last]
        self.lens = start + n_keep

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> DraftOut:
        assert self.last_hidden is not None, "observe() first"
        h = self.last_hidden
        toks, prob_steps, hs = [], [], []
        for j in range(self.d.gamma):
            hs.append(h)
            tok, pk = choose(self.shared.logits(h), temperature, generator)
            toks.append(tok)
            prob_steps.append(pk)
            if j + 1 < self.d.gamma:
                pos = (self.lens + j).unsqueeze(1)
                x = self.d.step_input(self.shared, h.unsqueeze(1), tok.unsqueeze(1))
                h = self._run(x, pos)[:, 0]
        hidden = torch.stack(hs, dim=1)
        probs = None if temperature <= 0 else torch.stack(prob_steps, dim=1)  # type: ignore[arg-type]
        return DraftOut(torch.stack(toks, dim=1), probs, self.d.confidence_head(hidden))


def make_runner(drafter: BlockDrafter | EagleDrafter, shared: SharedTarget, batch: int,
                max_len: int) -> BlockDraftRunner | EagleDraftRunner:
    if isinstance(drafter, EagleDrafter):
        return EagleDraftRunner(drafter, shared, batch, max_len)
    return BlockDraftRunner(drafter, shared, batch, max_len)
