"""Layer: test tooling (no SGLang import). Hugging Face transformers as the reference engine."""
from __future__ import annotations

import os
from pathlib import Path


def hf_greedy(model_path: str | os.PathLike[str] | Path, prompts: list[list[int]], n: int, dtype: str = "float32") -> list[list[int]]:
    """Greedy continuation of each prompt (token ids) by transformers, `n` tokens, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    outs: list[list[int]] = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(ids):].tolist())
    return outs
