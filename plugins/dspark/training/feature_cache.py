"""Layer: plugin tooling (no SGLang import). The target's features of every training sequence, computed once.

Training used to run the frozen target over each batch at every step; with a 135M target that
forward cost more than the drafter's step. `FeatureCache` runs the target once over all
sequences (batched, sorted by length), keeps tokens and the captured layers' hidden states
flat on the device (about 3.5 KB per token for three SmolLM2 layers in bf16), and assembles
padded batches by indexing. `batch` returns what `pad_batch` + `LlamaTarget.full_forward` return for
the same sequences on every real position (tested; padding positions hold zeros).
`share` / `from_shared` hand the device tensors to other processes (torch.multiprocessing with
spawn: CUDA IPC, no copy), so that several drafters trained side by side on one GPU read one cache.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget
from kllm_plugins.plugins.dspark.training.data import pad_batch

logger = logging.getLogger("kllm.dspark")


class FeatureCache:
    def __init__(self, target: LlamaTarget, seqs: Sequence[tuple[list[int], int]], layers: Sequence[int],
                 *, max_batch_tokens: int = 65536) -> None:
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
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        lo = 0
        while lo < len(order):
            hi = lo + 1
            while hi < len(order) and (hi + 1 - lo) * len(seqs[order[hi]][0]) <= max_batch_tokens:
                hi += 1
            idx = order[lo:hi]
            tokens, _, blens = pad_batch([seqs[i] for i in idx], 0, dev)
            _, feats = target.full_forward(tokens, capture_layers=layers, want_logits=False)
            assert feats is not None
            for row, i in enumerate(idx):
                o, n = int(self.offsets[i]), int(blens[row])
                self.feats[o:o + n] = feats[row, :n]
            lo = hi
        logger.info("feature cache: %d sequences, %d tokens, %.2f GB", len(seqs), total,
                    self.feats.numel() * self.feats.element_size() / 1e9)

    def share(self) -> dict[str, object]:
        """What another process needs to read this cache (pass it through torch.multiprocessing)."""
        return {"tokens": self.tokens, "feats": self.feats, "lens": self.lens, "plens": self.plens,
                "offsets": self.offsets, "lens_host": list(self.lens_host)}

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
