"""Layer: host tooling (no SGLang import). A tiny Llama built locally and deterministically.

Random weights from a fixed seed and a byte-level BPE tokenizer trained on Python's own
standard-library sources (text every machine with this Python has), so nothing is downloaded.
Built once and cached; the folder name carries a recipe version so a changed recipe rebuilds.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from kllm_plugins.models.cache_dir import build_once

RECIPE = "v2"
VOCAB = 4096
LM_HEAD_SCALE = 8.0
CORPUS_MODULES = (
    "this.py", "argparse.py", "textwrap.py", "string.py", "calendar.py", "pprint.py",
    "difflib.py", "statistics.py", "fractions.py", "json/__init__.py", "csv.py", "heapq.py",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def corpus_lines() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for rel in CORPUS_MODULES:
        lines += (stdlib / rel).read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()]


def _build(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # no progress bars: the Rust trainer writes them to stdout, where `$(kllm-plugins build-model tiny)`
    # and scripts expect the path alone
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.1,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights give nearly flat logits, where bf16 rounding flips the argmax between
        # engines. A sharper LM head keeps greedy decoding comparable token for token.
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "kllm_recipe.json").write_text(json.dumps({"recipe": RECIPE, "kind": "tiny-llama"}))


def tiny_llama_path() -> Path:
    """Path of the tiny Llama, building it on first use (a few seconds)."""
    return build_once(f"tiny-llama-{RECIPE}", _build)


if __name__ == "__main__":
    print(tiny_llama_path())
