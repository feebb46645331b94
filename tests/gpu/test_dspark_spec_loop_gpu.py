"""The reference speculative loop on CUDA: the same code as on CPU, greedy output equal to the
target's own greedy decoding (float32; bf16 near-ties can flip, see docs/dspark.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_dspark_spec_loop import PROMPTS, drafter_for, random_target  # noqa: E402

from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner  # noqa: E402
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget  # noqa: E402
from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate, speculative_generate  # noqa: E402
from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget  # noqa: E402


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle"])
def test_greedy_equals_target_greedy_on_cuda(kind: str) -> None:
    cpu = random_target(16, seed=3, dtype=torch.float32)
    state = {"model.embed_tokens.weight": cpu.embed, "lm_head.weight": cpu.lm_head, "model.norm.weight": cpu.final_norm}
    for i, w in enumerate(cpu.layers):
        p = f"model.layers.{i}."
        q, k, v = w["qkv"].split([32, 16, 16])
        g, u = w["gate_up"].chunk(2)
        state.update({p + "input_layernorm.weight": w["ln1"], p + "post_attention_layernorm.weight": w["ln2"],
                      p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                      p + "self_attn.o_proj.weight": w["o"], p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u,
                      p + "mlp.down_proj.weight": w["down"]})
    target = LlamaTarget(cpu.shape, state, device="cuda", dtype=torch.float32)
    model = drafter_for(cpu, kind, gamma=3).float().cuda()
    shared = SharedTarget(target.embed, target.lm_head)
    ref_gpu = autoregressive_generate(target, PROMPTS, max_new_tokens=25)
    res = speculative_generate(target, lambda b, m: make_runner(model, shared, b, m), PROMPTS, gamma=3,
                               max_new_tokens=25, capture_layers=[0, 1])
    assert res.outputs == ref_gpu.outputs
    assert res.accept_lengths().numel() > 0
