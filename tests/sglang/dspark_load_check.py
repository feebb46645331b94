"""Run in a fresh process by test_dspark_checkpoint.py: build SGLang's DSPARK draft model from our
checkpoint on CPU and load it. Prints one JSON line with what was checked.

Usage: python tests/sglang/dspark_load_check.py TARGET_DIR CHECKPOINT_DIR...
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("SGLANG_PLATFORM", "kllm_cpu")
os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"  # else SGLang builds no confidence head

import torch  # noqa: E402


def setup(target: Path) -> None:
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    rc.publish(ServerArgs(model_path=str(target), device="cpu"), role="test")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=0, backend="gloo")
    ps.initialize_model_parallel(backend="gloo")


def check(ckpt: Path) -> dict:
    from safetensors.torch import load_file
    from sglang.srt.models.dspark import DSparkDraftModel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config
    from sglang.srt.speculative.dspark_components.dspark_sts import load_sts_calibration_from_path
    from transformers import AutoConfig

    from kllm_plugins.plugins.dspark.training.export import load_drafter

    hf_cfg = AutoConfig.from_pretrained(str(ckpt))
    arch = hf_cfg.architectures[0]
    cls, _ = ModelRegistry.resolve_model_cls([arch])
    model = cls(hf_cfg).float()
    assert isinstance(model, DSparkDraftModel), type(model)
    parsed = parse_dspark_draft_config(draft_hf_config=hf_cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    state = load_file(str(ckpt / "model.safetensors"))
    model.load_weights(list(state.items()))

    # every parameter was written (no NaN left) and every checkpoint key names a parameter
    stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    unexpected = []
    for key in state:
        name = key
        # SGLang hands markov_head.* / confidence_head.* to the heads as named (no stacking)
        for src, dst in ({} if key.startswith(("markov_head.", "confidence_head.")) else stacked).items():
            if f".{src}." in key:
                name = key.replace(src, dst)
        if name not in params:
            unexpected.append(key)
    missing = sorted(n for n, p in params.items() if torch.isnan(p).any())

    ours = load_drafter(ckpt).float().eval()
    checks: dict[str, float] = {}
    with torch.no_grad():
        torch.manual_seed(0)
        h = hf_cfg.hidden_size
        k_feats = len(parsed.target_layer_ids or [])
        feats = torch.randn(5, k_feats * h)
        checks["fc_hidden_norm"] = float((model.project_target_hidden(feats) - ours.context_hidden(feats)).abs().max())
        x = torch.randn(5, h)
        checks["mlp0"] = float((model.layers[0].mlp(x) - ours.layers[0].mlp(x)).abs().max())
        prev = torch.randint(0, hf_cfg.vocab_size, (5,))
        bias_s, state_s = model.markov_head.step_bias(prev, hidden_states=x, state=model.markov_head.init_state(x))
        bias_o, state_o = ours.markov_head.step_bias(prev, x, ours.markov_head.init_state(x))
        checks["markov_bias"] = float((bias_s - bias_o).abs().max())
        for _ in range(2):  # a second step exercises the recurrent state
            bias_s, state_s = model.markov_head.step_bias(prev, hidden_states=x, state=state_s)
            bias_o, state_o = ours.markov_head.step_bias(prev, x, state_o)
        checks["markov_bias_step3"] = float((bias_s - bias_o).abs().max())
        gamma = parsed.gamma
        feats_c = torch.randn(2 * gamma, h)
        anchor = torch.randint(0, hf_cfg.vocab_size, (2,))
        drafts = torch.randint(0, hf_cfg.vocab_size, (2, gamma))
        _, raw_s = model.confidence_head.predict(feats_c, anchor_tokens=anchor, draft_tokens=drafts,
                                                 markov_head=model.markov_head)
        prev_stack = torch.cat([anchor.view(-1, 1), drafts[:, :-1]], dim=1)
        raw_o = ours.confidence_head(feats_c.view(2, gamma, h), ours.markov_head.prev_embed(prev_stack))
        checks["confidence_raw"] = float((raw_s - raw_o).abs().max())
    sts = load_sts_calibration_from_path(str(ckpt / "dspark_sts.json"))
    return {
        "arch": arch, "class": type(model).__name__, "markov_head": type(model.markov_head).__name__,
        "params": len(params), "keys": len(state), "missing": missing, "unexpected": unexpected,
        "gamma": parsed.gamma, "markov_rank": parsed.markov_rank, "mask_token_id": parsed.mask_token_id,
        "target_layer_ids": parsed.target_layer_ids, "sts_temperatures": len(sts.temperatures), "checks": checks,
    }


if __name__ == "__main__":
    setup(Path(sys.argv[1]))
    for folder in sys.argv[2:]:
        print("RESULT " + json.dumps({"folder": folder, **check(Path(folder))}))
