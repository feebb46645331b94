"""Layer: plugin tooling (no SGLang import). Training data: prompts, the target's own answers, batches.

The drafter learns to predict the target, so the training text is the target's greedy answer to
each prompt (prompt tokens are context only). `TokenizedPrompts` is what travels to a machine
without a tokenizer; `generate_answers` runs there with the reference Llama.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate
from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget

logger = logging.getLogger("kllm.dspark")


@dataclass
class TokenizedPrompts:
    train: list[list[int]]
    calib: list[list[int]]
    test: list[list[int]]
    eos_id: int
    source: str

    def save(self, path: Path) -> None:
        torch.save({"train": self.train, "calib": self.calib, "test": self.test, "eos_id": self.eos_id,
                    "source": self.source}, path)

    @classmethod
    def load(cls, path: Path) -> "TokenizedPrompts":
        d = torch.load(path, weights_only=True)
        return cls(d["train"], d["calib"], d["test"], int(d["eos_id"]), str(d["source"]))


def tokenize_prompts(tokenizer: Any, texts: Sequence[str], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-formatted prompt ids (generation prompt appended); prompts longer than the cap are skipped."""
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(x) for x in ids]
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def split_prompts(prompts: list[list[int]], *, n_calib: int, n_test: int, seed: int = 0) -> tuple[list, list, list]:
    """Held-out splits are disjoint from training prompts (shuffled with a fixed seed)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    test = [prompts[i] for i in order[:n_test]]
    calib = [prompts[i] for i in order[n_test:n_test + n_calib]]
    train = [prompts[i] for i in order[n_test + n_calib:]]
    return train, calib, test


def generate_answers(target: LlamaTarget, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int,
                     batch_size: int = 256) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer, prompt length) per prompt; batches sorted by prompt length."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    seqs: list[tuple[list[int], int] | None] = [None] * len(prompts)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        batch = [list(prompts[i]) for i in idx]
        res = autoregressive_generate(target, batch, max_new_tokens=max_new_tokens, eos_id=eos_id)
        for i, p, ans in zip(idx, batch, res.outputs):
            seqs[i] = (p + ans, len(p))
        logger.info("generated %d/%d answers", min(lo + batch_size, len(order)), len(order))
    return [s for s in seqs if s is not None]


def pad_batch(seqs: Sequence[tuple[list[int], int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B,T], prompt lengths [B], true lengths [B]."""
    t = max(len(s) for s, _ in seqs)
    tokens = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    for i, (s, _) in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    plen = torch.tensor([p for _, p in seqs], dtype=torch.long)
    lens = torch.tensor([len(s) for s, _ in seqs], dtype=torch.long)
    return tokens.to(device), plen.to(device), lens.to(device)
