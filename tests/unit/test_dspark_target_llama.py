"""The reference Llama (ragged KV cache) against transformers on the tiny Llama."""
from __future__ import annotations

import json

import pytest
import torch

from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, LlamaTarget, default_target_layers


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from safetensors.torch import load_file

    cfg = json.loads((tiny_model_path / "config.json").read_text())
    return cfg, load_file(str(tiny_model_path / "model.safetensors"))


def test_logits_and_hidden_states_match_transformers(tiny, tiny_model_path) -> None:
    from transformers import AutoModelForCausalLM

    cfg, state = tiny
    ours = LlamaTarget(LlamaShape.from_hf_config(cfg), state, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    x = torch.randint(0, cfg["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
    logits, feats = ours.full_forward(x, capture_layers=[0, 2])
    h = cfg["hidden_size"]
    assert torch.allclose(logits, ref.logits, atol=1e-4, rtol=1e-4)
    # capture_layers=[l] is the output of layer l = transformers' hidden_states[l + 1]
    assert torch.allclose(feats[..., :h], ref.hidden_states[1], atol=1e-5)
    assert torch.allclose(feats[..., h:], ref.hidden_states[3], atol=1e-5)


def test_ragged_cache_rows_advance_independently(tiny) -> None:
    cfg, state = tiny
    ours = LlamaTarget(LlamaShape.from_hf_config(cfg), state, device="cpu", dtype=torch.float64)
    x = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    full, _ = ours.full_forward(x)
    cache = ours.new_cache(2, 32)
    # row 0 commits 4 then 8 tokens; row 1 commits 7 then 5; junk written past a row's length
    # (a rejected draft) must not leak into later steps
    first = torch.stack([torch.cat([x[0, :4], x[0, :3]]), x[1, :7]])
    out1, _ = ours.forward(first, cache)
    cache.advance(torch.tensor([4, 7]))
    second = torch.stack([x[0, 4:9], torch.cat([x[1, 7:12]])])
    out2, _ = ours.forward(second, cache)
    assert torch.allclose(out1[0, :4], full[0, :4], atol=1e-9)
    assert torch.allclose(out2[0], full[0, 4:9], atol=1e-9)
    assert torch.allclose(out1[1], full[1, :7], atol=1e-9)
    assert torch.allclose(out2[1], full[1, 7:12], atol=1e-9)
    with pytest.raises(ValueError, match="overflow"):
        ours.forward(torch.zeros(2, 40, dtype=torch.long), cache)


def test_default_target_layers_are_spread_and_in_range() -> None:
    assert default_target_layers(30, 3) == [1, 14, 27]
    assert default_target_layers(4, 2) == [1, 2]
    assert default_target_layers(4, 3) == [1, 2]  # SGLang never captures a target's last layer
    with pytest.raises(ValueError):
        default_target_layers(4, 0)
