"""Layer: plugin core (torch only, no SGLang import). The reference speculative decoding loop.

Lossless verification, the same code on CPU and GPU, batched with ragged acceptance:
- greedy (temperature 0): drafts are accepted while they equal the target's argmax; the
  token after the accepted run is the target's argmax there, so the output is the target's
  own greedy decoding token for token.
- sampling: draft k (drawn from q_k) is accepted with probability min(1, p_k/q_k); at the first
  rejection the token is drawn from norm(max(p_k - q_k, 0)); if all are accepted, the bonus
  token is drawn from p. The output is distributed as the target's sampling (Leviathan et al.,
  Chen et al. 2023); `tests/unit/test_dspark_spec_loop.py` checks it with a chi-square test.
`verify_len` L verifies [anchor, d_1..d_{L-1}] (L = gamma + 1 verifies the whole block).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kllm_plugins.plugins.dspark.core.draft_runtime import DraftOut
from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget

logger = logging.getLogger("kllm.dspark")


@dataclass
class StepRecord:
    """One verify step of one batch: per active row the accepted draft count and the confidences."""

    accepted: torch.Tensor      # [R] drafts accepted (0..L-1)
    confidence: torch.Tensor    # [R, gamma] raw confidence logits
    verify_len: int
    batch: int


@dataclass
class SpecResult:
    outputs: list[list[int]]
    seconds: float
    steps: int
    records: list[StepRecord] = field(default_factory=list)

    def accept_lengths(self) -> torch.Tensor:
        """Tokens gained per verify step (accepted drafts + 1), over all active rows."""
        if not self.records:
            return torch.zeros(0)
        return torch.cat([r.accepted for r in self.records]).float() + 1.0

    def position_accept_rates(self, gamma: int) -> list[float]:
        """P(draft k accepted), k = 1..gamma."""
        acc = torch.cat([r.accepted for r in self.records]) if self.records else torch.zeros(0)
        if acc.numel() == 0:
            return [0.0] * gamma
        return [float((acc >= k).float().mean()) for k in range(1, gamma + 1)]

    def verify_tokens(self) -> int:
        return sum(r.verify_len * r.accepted.numel() for r in self.records)

    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def verify(draft: DraftOut, logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted count n [B] and the next token [B] from target logits [B, L, V] over [anchor, d_1..d_{L-1}]."""
    b, length, _ = logits.shape
    d = draft.tokens[:, : length - 1]
    rows = torch.arange(b, device=logits.device)
    if temperature <= 0:
        pred = logits.argmax(-1)
        match = (d == pred[:, : length - 1]).long()
        n = match.cumprod(dim=1).sum(dim=1)
        return n, pred[rows, n]
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if draft.probs is None:  # a greedy drafter: q is one-hot at d
        q = torch.nn.functional.one_hot(draft.tokens, p.shape[-1]).float()
    else:
        q = draft.probs
    q = q[:, : length - 1]
    p_d = p[:, : length - 1].gather(-1, d.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, d.unsqueeze(-1)).squeeze(-1).clamp_min(1e-20)
    u = torch.rand(p_d.shape, device=p.device, generator=generator)
    acc = (u < (p_d / q_d).clamp(max=1.0)).long()
    n = acc.cumprod(dim=1).sum(dim=1)
    residual = p[rows, n].clone()
    rejected = n < length - 1
    if bool(rejected.any()):
        q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)
        r = (p[rows, n] - q_pad[rows, n]).clamp_min(0)
        norm = r.sum(-1, keepdim=True)
        r = torch.where(norm > 0, r / norm.clamp_min(1e-30), p[rows, n])
        residual = torch.where(rejected.unsqueeze(-1), r, residual)
    return n, _sample(residual, generator)


def _pad(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(p) for p in prompts)
    out = torch.full((len(prompts), t), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return out.to(device), lens.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_generate(target: LlamaTarget, make_runner: Callable[[int, int], object], prompts: Sequence[Sequence[int]],
                         *, gamma: int, max_new_tokens: int, capture_layers: Sequence[int],
                         verify_len: int | None = None, temperature: float = 0.0, eos_id: int | None = None,
                         generator: torch.Generator | None = None, record: bool = True) -> SpecResult:
    """Generate up to `max_new_tokens` per prompt with drafts from `make_runner(batch, max_len)`."""
    dev = target.device
    length = gamma + 1 if verify_len is None else verify_len
    if not 1 <= length <= gamma + 1:
        raise ValueError(f"verify_len must be in 1..{gamma + 1}")
    b = len(prompts)
    toks, plens = _pad(prompts, 0, dev)
    # a finished row may have committed a whole block past the cap and still runs (idle) blocks
    max_len = int(plens.max()) + max_new_tokens + 2 * (gamma + 1) + 2
    cache = target.new_cache(b, max_len)
    runner = make_runner(b, max_len)
    outputs: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    _sync(dev)
    t0 = time.perf_counter()
    logits, feats = target.forward(toks, cache, capture_layers=capture_layers, logits_index=plens - 1)
    last = logits[:, 0]
    bonus = last.argmax(-1) if temperature <= 0 else _sample(torch.softmax(last / temperature, -1), generator)
    runner.observe(feats, cache.lens.clone(), plens, toks, bonus)  # type: ignore[attr-defined]
    cache.advance(plens)
    records: list[StepRecord] = []
    steps = 0

    def emit(i: int, new: list[int]) -> None:
        out = outputs[i]
        for tok in new:
            if len(out) >= max_new_tokens:
                break
            out.append(tok)
            if eos_id is not None and tok == eos_id:
                break
        if len(out) >= max_new_tokens or (eos_id is not None and out and out[-1] == eos_id):
            done[i] = True

    for i, tok in enumerate(bonus.tolist()):
        emit(i, [tok])
    while not bool(done.all()):
        draft = runner.propose(bonus, temperature, generator)  # type: ignore[attr-defined]
        verify_in = torch.cat([bonus.unsqueeze(1), draft.tokens[:, : length - 1]], dim=1)
        logits, feats = target.forward(verify_in, cache, capture_layers=capture_layers)
        n, nxt = verify(draft, logits, temperature, generator)
        start = cache.lens.clone()
        keep = torch.where(done.to(dev), torch.zeros_like(n), n + 1)  # finished rows stay put
        runner.observe(feats, start, keep, verify_in, nxt)  # type: ignore[attr-defined]
        cache.advance(keep)
        steps += 1
        n_cpu, acc_tokens, nxt_cpu = n.cpu(), draft.tokens.cpu(), nxt.cpu()
        active = ~done
        if record:
            records.append(StepRecord(n_cpu[active].clone(), draft.confidence_logits.float().cpu()[active], length, b))
        for i in torch.nonzero(active).flatten().tolist():
            k = int(n_cpu[i])
            emit(i, acc_tokens[i, :k].tolist() + [int(nxt_cpu[i])])
        bonus = nxt
    _sync(dev)
    return SpecResult(outputs, time.perf_counter() - t0, steps, records)


def autoregressive_generate(target: LlamaTarget, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                            temperature: float = 0.0, eos_id: int | None = None,
                            generator: torch.Generator | None = None) -> SpecResult:
    """The target alone, one token per step (the baseline and the greedy reference)."""
    dev = target.device
    b = len(prompts)
    toks, plens = _pad(prompts, 0, dev)
    cache = target.new_cache(b, int(plens.max()) + max_new_tokens + 2)
    outputs: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    _sync(dev)
    t0 = time.perf_counter()
    logits, _ = target.forward(toks, cache, logits_index=plens - 1)
    last = logits[:, 0]
    cache.advance(plens)
    steps = 0
    while True:
        nxt = last.argmax(-1) if temperature <= 0 else _sample(torch.softmax(last / temperature, -1), generator)
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                outputs[i].append(tok)
                done[i] = len(outputs[i]) >= max_new_tokens or (eos_id is not None and tok == eos_id)
        if all(done):
            break
        logits, _ = target.forward(nxt.unsqueeze(1), cache)
        cache.advance(torch.ones(b, dtype=torch.long, device=dev))
        last = logits[:, 0]
        steps += 1
    _sync(dev)
    return SpecResult(outputs, time.perf_counter() - t0, steps)
