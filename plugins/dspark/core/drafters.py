"""Layer: plugin core (torch only, no SGLang import). The three drafters: DSpark, DFlash-style, EAGLE-style.

`BlockDrafter` is the parallel (DFlash-style) block drafter: a few decoder layers whose queries
are [anchor, mask x (gamma-1)] at the next gamma positions and whose keys are the block itself
(bidirectional) plus the context, i.e. the target's hidden states at `target_layer_ids` projected
by `fc` + `hidden_norm` and turned into K/V by each layer's own k/v projections (no input norm),
exactly as SGLang's `DFlashDraftModel` materialises them. Row k of the block predicts the token
at anchor + k + 1 through the target's (shared, frozen) `lm_head`.
With a Markov head (`kind="dspark"`) step k's logits get the head's bias from the token drafted
at step k-1 and the confidence head scores each step; without (`kind="dflash"`) the block is
drafted by independent per-position choices.

`EagleDrafter` is an autoregressive head (EAGLE-3 style): each step is a causal decoder pass
over [feature ; embedding of the next token], where the feature is the target's (projected)
hidden state for context positions and the head's own output for drafted ones. It is trained
with training-time test (`gamma` unrolled steps).

Parameter budget: `parameter_count` counts trainable parameters (the target's embedding and
lm_head are shared and not counted); the benchmark sizes the three to within a few percent.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from kllm_plugins.plugins.dspark.core.draft_layers import DraftLayer, RMSNorm, gqa_attention
from kllm_plugins.plugins.dspark.core.markov_heads import (MARKOV_HEAD_TYPES, ConfidenceHead, TiedMarkovHead,
                                                           build_markov_head)

DRAFTER_KINDS = ("dspark", "dflash", "eagle")


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    max_position_embeddings: int = 8192
    markov_tied: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.kind == "dspark" and self.markov_rank <= 0:
            raise ValueError("markov_rank must be > 0 for a dspark drafter")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError("mask_token_id must be a token id of the target vocabulary")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        d = dict(d)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return cls(**d)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class SharedTarget:
    """The target's embedding and lm_head, shared by every drafter and never trained."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.embed = embed
        self.lm_head = lm_head

    def embed_tokens(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.embed).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.to(self.lm_head.dtype) @ self.lm_head.T).float()


class BlockDrafter(nn.Module):
    """DSpark (with Markov + confidence head) or DFlash-style (confidence head only) block drafter."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        if cfg.kind not in ("dspark", "dflash"):
            raise ValueError("BlockDrafter is for kind dspark or dflash")
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList([DraftLayer(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                                cfg.rms_norm_eps, cfg.rope_theta) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov_head: nn.Module | None = None
        if cfg.kind == "dspark":
            self.markov_head = (TiedMarkovHead(cfg.markov_head_type, cfg.markov_rank, h) if cfg.markov_tied
                                else build_markov_head(cfg.markov_head_type, cfg.vocab_size, cfg.markov_rank, h))
        self.confidence_head = ConfidenceHead(h, cfg.markov_rank if cfg.kind == "dspark" else 0)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2 and "markov" not in name and "confidence" not in name:
                nn.init.normal_(p, std=0.02)
        for layer in self.layers:
            nn.init.normal_(layer.self_attn.o_proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))
            nn.init.normal_(layer.mlp.down_proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))

    @property
    def gamma(self) -> int:
        return self.cfg.block_size

    def context_hidden(self, feats: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ctx = self.context_hidden(feats)
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(self, embeds: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                     mask: torch.Tensor) -> torch.Tensor:
        x = embeds
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x, _, _ = layer(x, positions, ck, cv, mask)
        return self.norm(x)

    def block_inputs(self, shared: SharedTarget, anchors: torch.Tensor) -> torch.Tensor:
        """Token ids of the query block: [anchor, mask x (gamma-1)], anchors [...]."""
        ids = anchors.new_full((*anchors.shape, self.gamma), self.cfg.mask_token_id)
        ids[..., 0] = anchors
        return ids

    # -- training -------------------------------------------------------------------------------
    def train_forward(self, shared: SharedTarget, feats: torch.Tensor, tokens: torch.Tensor,
                      anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Teacher-forced block predictions for anchor positions.

        feats [B,T,K*H] target features; tokens [B,T]; anchors [B,N] positions (each needs
        anchor + gamma < T). Returns step logits [B,N,gamma,V], labels [B,N,gamma], confidence
        logits [B,N,gamma] (computed on detached features: the confidence head does not train
        the drafter).
        """
        b, t = tokens.shape
        n, g = anchors.shape[1], self.gamma
        dev = tokens.device
        pos_ctx = torch.arange(t, device=dev).expand(b, t)
        ctx_kv = self.context_kv(feats, pos_ctx)
        offs = torch.arange(g, device=dev)
        block_pos = (anchors.unsqueeze(-1) + offs).reshape(b, n * g)
        anchor_tok = tokens.gather(1, anchors)
        embeds = shared.embed_tokens(self.block_inputs(shared, anchor_tok).reshape(b, n * g), self.fc.weight.dtype)
        # ctx key j visible to block i iff j < anchor_i; block keys visible within the same block
        ctx_mask = torch.arange(t, device=dev).view(1, 1, t) < anchors.repeat_interleave(g, dim=1).unsqueeze(-1)
        blk = torch.arange(n, device=dev).repeat_interleave(g)
        blk_mask = (blk.view(-1, 1) == blk.view(1, -1)).expand(b, n * g, n * g)
        hidden = self.block_hidden(embeds, block_pos, ctx_kv, torch.cat([ctx_mask, blk_mask], dim=-1))
        hidden = hidden.view(b, n, g, -1)
        label_idx = (anchors.unsqueeze(-1) + offs + 1)
        labels = tokens.gather(1, label_idx.reshape(b, n * g)).view(b, n, g)
        prev = torch.cat([anchor_tok.unsqueeze(-1), labels[..., :-1]], dim=-1)
        prev_embed = None
        if self.markov_head is None:
            logits = shared.logits(hidden)
        else:
            state = None
            steps = []
            for k in range(g):  # teacher-forced: step k sees the target's token at step k-1
                lk, state = self.markov_step(shared, prev[..., k], hidden[..., k, :], state)
                steps.append(lk)
            logits = torch.stack(steps, dim=-2)
            prev_embed = self.markov_prev_embed(shared, prev)
        conf = self.confidence_head(hidden.detach(), None if prev_embed is None else prev_embed.detach())
        return {"logits": logits, "labels": labels, "confidence": conf}

    def markov_prev_embed(self, shared: SharedTarget, tokens: torch.Tensor) -> torch.Tensor:
        """W1[x] (what the confidence head reads beside h)."""
        head = self.markov_head
        assert head is not None
        return head.prev_embed(tokens, shared.embed) if isinstance(head, TiedMarkovHead) else head.prev_embed(tokens)

    def markov_step(self, shared: SharedTarget, prev: torch.Tensor, hidden: torch.Tensor,
                    state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step logits (base + Markov bias from the previous token) and the head's new state."""
        head = self.markov_head
        assert head is not None
        if isinstance(head, TiedMarkovHead):
            shift, state = head.step_shift(prev, hidden, state, shared.embed)
            return shared.logits(hidden + shift.to(hidden.dtype)), state
        bias, state = head.step_bias(prev, hidden, state)
        return shared.logits(hidden) + bias.float(), state


class EagleDrafter(nn.Module):
    """Autoregressive head over [feature ; next-token embedding], EAGLE-3 style."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        if cfg.kind != "eagle":
            raise ValueError("EagleDrafter is for kind eagle")
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.in_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DraftLayer(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                                cfg.rms_norm_eps, cfg.rope_theta) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.confidence_head = ConfidenceHead(h, 0)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    @property
    def gamma(self) -> int:
        return self.cfg.block_size

    def step_input(self, shared: SharedTarget, feature: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        e = shared.embed_tokens(next_tokens, self.in_proj.weight.dtype)
        return self.in_proj(torch.cat([feature.to(e.dtype), e], dim=-1))

    def context_feature(self, feats: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def train_forward(self, shared: SharedTarget, feats: torch.Tensor, tokens: torch.Tensor,
                      valid_from: torch.Tensor, valid_to: torch.Tensor) -> dict[str, torch.Tensor]:
        """Training-time test over `gamma` unrolled steps.

        Step j (1-based) at position p continues the chain anchored at a = p - j + 2 and predicts
        x[p + 2]; its input is [f_p (j = 1) or the step j-1 output at p-1 ; emb(x[p+1])]. Its keys:
        step-1 keys at positions <= a - 1 and step-i keys at position a + i - 2 (i = 2..j).
        Only chains anchored in [valid_from, valid_to - j] are trained, so steps 2..gamma run over
        each row's window p in [valid_from, valid_to - 2] alone (step 1 runs over every position:
        its keys are every chain's context); with long prompts that skips most of their cost.
        Returns hidden [B,gamma,T,H] (logits are taken by the caller on the masked rows only;
        zeros outside the window), labels [B,gamma,T], mask [B,gamma,T] (anchor in
        [valid_from, valid_to - j] per row), confidence logits [B,gamma,T].
        """
        b, t = tokens.shape
        dev = tokens.device
        g = self.gamma
        pos = torch.arange(t, device=dev).expand(b, t)
        next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
        p_idx = torch.arange(t, device=dev)
        valid_from = valid_from.to(dev).long().clamp(0, t - 1)
        # step 1 over every position: [B,T] queries, causal keys s <= p
        x = self.step_input(shared, self.context_feature(feats), next_tok)
        step1_keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        causal = p_idx.view(1, t) <= p_idx.view(t, 1)
        for layer in self.layers:
            h = layer.input_layernorm(x)
            q = layer.self_attn.q(h, pos)
            k, v = layer.self_attn.kv(h, pos)
            step1_keys.append((k, v))
            x = x + layer.self_attn.out(gqa_attention(q, k, v, causal))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden1 = self.norm(x)
        # steps 2..g over the window w -> p = valid_from + w (w < width), per row
        width = max(1, min(t, int((valid_to.to(dev).long() - valid_from - 1).max().clamp_min(1))))
        w_idx = torch.arange(width, device=dev)
        win = (valid_from.view(b, 1) + w_idx.view(1, width)).clamp(max=t - 1)          # [B,W] absolute p
        win_tok = next_tok.gather(1, win)
        feature = hidden1.gather(1, (win - 1).clamp_min(0).unsqueeze(-1).expand(b, width, hidden1.shape[-1]))
        keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        outs = []
        sw = w_idx.view(1, width)
        pw = w_idx.view(width, 1)
        s_abs = p_idx.view(1, 1, t)
        for j in range(2, g + 1):
            x = self.step_input(shared, feature, win_tok)
            # step-1 keys s <= p - j + 1 (absolute, per row); step-i keys (i >= 2) at window w - j + i
            mask1 = s_abs <= (win - j + 1).unsqueeze(-1)
            parts = [mask1] + [(sw == pw - j + i).expand(b, width, width) for i in range(2, j + 1)]
            mask = torch.cat(parts, dim=-1)
            for li, layer in enumerate(self.layers):
                h = layer.input_layernorm(x)
                q = layer.self_attn.q(h, win)
                k, v = layer.self_attn.kv(h, win)
                keys[li].append((k, v))
                k_all = torch.cat([step1_keys[li][0]] + [kv[0] for kv in keys[li]], dim=2)
                v_all = torch.cat([step1_keys[li][1]] + [kv[1] for kv in keys[li]], dim=2)
                x = x + layer.self_attn.out(gqa_attention(q, k_all, v_all, mask))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            hidden = self.norm(x)
            outs.append(hidden)
            # next step: feature at window w is this step's output at w-1
            feature = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
        hidden_all = hidden1.new_zeros(b, g, t, hidden1.shape[-1])
        hidden_all[:, 0] = hidden1
        if outs:
            # window rows clamped to t - 1 are duplicates of a real row; write each position once
            keep = (valid_from.view(b, 1) + w_idx.view(1, width)) < t
            rows = torch.arange(b, device=dev).view(b, 1).expand(b, width)[keep]
            cols = win[keep]
            for j, hj in enumerate(outs, start=2):
                hidden_all[rows, j - 1, cols] = hj[keep].to(hidden_all.dtype)
        label_pos = (p_idx + 2).clamp(max=t - 1)
        labels = tokens[:, label_pos].unsqueeze(1).expand(b, g, t)
        js = torch.arange(1, g + 1, device=dev).view(1, g, 1)
        anchor = p_idx.view(1, 1, t) - js + 2
        mask_all = (anchor >= valid_from.view(b, 1, 1)) & (anchor + js <= valid_to.to(dev).view(b, 1, 1))
        return {
            "hidden": hidden_all,
            "labels": labels,
            "mask": mask_all,
            "confidence": self.confidence_head(hidden_all.detach()),
        }


def build_drafter(cfg: DrafterConfig) -> nn.Module:
    return EagleDrafter(cfg) if cfg.kind == "eagle" else BlockDrafter(cfg)
