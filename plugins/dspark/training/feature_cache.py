"""Layer: plugin tooling (no SGLang import). The target's features of every training sequence, computed once.

Training used to run the frozen target over each batch at every step; with a 135M target that
forward cost more than the drafter's step. `FeatureCache` runs the target once over all
sequences (batched, sorted by length), keeps tokens and the captured layers' hidden states
flat on the device (about 3.5 KB per token for three SmolLM2 layers in bf16), and assembles
padded batches by indexing. `batch` returns what `pad_batch` + `LlamaTarget.full_forward` return for
the same sequences on every real position (tested; padding positions hold zeros).
`share` / `from_shared` hand the device tensors to other processes (torch.multiprocessing with
spawn: CUDA IPC, no copy), so that several drafters trained side by side on one GPU read one cache.

With `final_hidden=True` (the distribution-matching loss) the cache also keeps, for every answer
position (prompt length .. length - 1), the target's final hidden state after its final norm: the
input of its lm_head, so the trainer gets the target's distribution there as `hidden @ lm_head.T`
(SmolLM2 ties lm_head to the embedding) without storing vocabulary-sized logits. Cost: one hidden
(H values) per answer token, i.e. 1/K of the K-layer features per answer token: for SmolLM2
(H = 576, bf16) 1,152 bytes per answer token, about 10.3 GB per GPU for run 5's 8.92M answer tokens
beside the 57.3 GB of three layers over all 16.6M tokens.
`final_batch` returns it padded like `batch` (zeros at prompt and padding positions).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget, rms_norm
from kllm_plugins.plugins.dspark.training.data import pad_batch

logger = logging.getLogger("kllm.dspark")


class FeatureCache:
    def __init__(self, target: LlamaTarget, seqs: Sequence[tuple[list[int], int]], layers: Sequence[int],
                 *, max_batch_tokens: int = 65536, final_hidden: bool = False) -> None:
        dev = target.device
        self.num_seqs = len(seqs)
        self.lens_host = [len(s) for s, _ in seqs]
        lens = torch.tensor(self.lens_host, dtype=torch.long)
        self.lens = lens.to(dev)
        self.plens = torch.tensor([p for _, p in seqs], dtype=torch.long, device=dev)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]]).to(dev)
        total = int(lens.sum())
        width = len(layers) * target.shape.hidden_size
        self.tokens = torch.cat([torch.tensor(s, dtype=torch.long) for s, _ in seqs]).to(dev)
        self.feats = torch.empty(total, width, device=dev, dtype=target.dtype)
        # answer positions only: the distribution loss needs the target's p at positions >= plen
        alens = torch.tensor([len(s) - p for s, p in seqs], dtype=torch.long)
        self.aoffsets = torch.cat([torch.zeros(1, dtype=torch.long), alens.cumsum(0)[:-1]]).to(dev)
        self.final: torch.Tensor | None = (torch.empty(int(alens.sum()), target.shape.hidden_size, device=dev,
                                                       dtype=target.dtype) if final_hidden else None)
        last = target.shape.num_layers - 1
        cap = sorted(set(layers) | ({last} if final_hidden else set()))
        h = target.shape.hidden_size
        pick = [cap.index(i) for i in layers]
        offs_host = self.offsets.tolist()  # host copies: no device sync per row below
        aoffs_host = self.aoffsets.tolist()
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        lo = 0
        while lo < len(order):
            hi = lo + 1
            while hi < len(order) and (hi + 1 - lo) * len(seqs[order[hi]][0]) <= max_batch_tokens:
                hi += 1
            idx = order[lo:hi]
            tokens, _, _ = pad_batch([seqs[i] for i in idx], 0, dev)
            _, raw = target.full_forward(tokens, capture_layers=cap, want_logits=False)
            assert raw is not None
            feats = torch.cat([raw[..., j * h:(j + 1) * h] for j in pick], dim=-1) if pick != list(range(len(cap))) else raw
            fin = None
            if self.final is not None:
                j = cap.index(last)
                fin = rms_norm(raw[..., j * h:(j + 1) * h], target.final_norm, target.shape.rms_norm_eps)
            for row, i in enumerate(idx):
                o, n = offs_host[i], len(seqs[i][0])
                self.feats[o:o + n] = feats[row, :n]
                if fin is not None:
                    p, ao = seqs[i][1], aoffs_host[i]
                    self.final[ao:ao + n - p] = fin[row, p:n]
            lo = hi
        logger.info("feature cache: %d sequences, %d tokens, %.2f GB", len(seqs), total,
                    self.feats.numel() * self.feats.element_size() / 1e9)

    def share(self) -> dict[str, object]:
        """What another process needs to read this cache (pass it through torch.multiprocessing)."""
        return {"tokens": self.tokens, "feats": self.feats, "lens": self.lens, "plens": self.plens,
                "offsets": self.offsets, "lens_host": list(self.lens_host), "aoffsets": self.aoffsets,
                "final": self.final}

    @classmethod
    def from_shared(cls, shared: dict[str, object]) -> "FeatureCache":
        self = cls.__new__(cls)
        for k, v in shared.items():
            setattr(self, k, v)
        self.num_seqs = len(self.lens_host)
        return self

    def batch(self, index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B,T] (0-padded), prompt lengths [B], lengths [B], features [B,T,K*H] for sequences `index`."""
        index = list(index)
        t = max(self.lens_host[i] for i in index)  # from the host copy: no device sync
        idx = torch.tensor(index, dtype=torch.long).to(self.lens.device, non_blocking=True)
        lens, plens, offs = self.lens[idx], self.plens[idx], self.offsets[idx]
        pos = torch.arange(t, device=idx.device).unsqueeze(0)
        valid = pos < lens.unsqueeze(1)
        flat = offs.unsqueeze(1) + torch.minimum(pos, (lens - 1).unsqueeze(1))
        tokens = torch.where(valid, self.tokens[flat], torch.zeros_like(flat))
        feats = self.feats[flat] * valid.unsqueeze(-1).to(self.feats.dtype)
        return tokens, plens, lens, feats

    def final_batch(self, index: Sequence[int]) -> torch.Tensor:
        """[B,T,H] the target's normed final hidden state at answer positions (zeros elsewhere), T as `batch`."""
        if self.final is None:
            raise ValueError("this feature cache was built without final_hidden=True")
        index = list(index)
        t = max(self.lens_host[i] for i in index)
        idx = torch.tensor(index, dtype=torch.long).to(self.lens.device, non_blocking=True)
        lens, plens, aoffs = self.lens[idx], self.plens[idx], self.aoffsets[idx]
        pos = torch.arange(t, device=idx.device).unsqueeze(0)
        valid = (pos >= plens.unsqueeze(1)) & (pos < lens.unsqueeze(1))
        flat = aoffs.unsqueeze(1) + (pos - plens.unsqueeze(1)).clamp(min=0)
        flat = torch.minimum(flat, (aoffs + (lens - plens - 1).clamp(min=0)).unsqueeze(1))
        flat = flat.clamp(max=max(0, self.final.shape[0] - 1))  # rows without an answer point past the end
        if self.final.shape[0] == 0:
            return self.final.new_zeros(len(index), t, self.final.shape[1])
        return self.final[flat] * valid.unsqueeze(-1).to(self.final.dtype)
