"""Layer: plugin tooling (no SGLang import). Write a DSpark drafter in the format SGLang's DSPARK loader reads.

Files: `config.json` (architecture `DSparkDraftModel`, Qwen3-style draft keys plus `block_size`,
`mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `sample_from_anchor`),
`model.safetensors` (unfused `q_proj/k_proj/v_proj`, `gate_proj/up_proj`, which SGLang's loader
stacks; no `embed_tokens`/`lm_head`, which are the target's), `dspark_sts.json` (per-position
temperatures for `--speculative-dspark-confidence-sts-path`) and `kllm_drafter.json` (our
own config, to rebuild the module for the reference loop).
A drafter trained with a tied Markov head (`markov_tied`) is exported as the equivalent untied
head (`TiedMarkovHead.materialize`), so both files describe an ordinary DSPARK draft model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kllm_plugins.plugins.dspark.core.drafters import BlockDrafter, DrafterConfig, SharedTarget, build_drafter
from kllm_plugins.plugins.dspark.core.markov_heads import TiedMarkovHead

ARCHITECTURE = "DSparkDraftModel"


def sglang_config(cfg: DrafterConfig, num_target_layers: int, dtype: str = "bfloat16") -> dict[str, Any]:
    if cfg.kind != "dspark":
        raise ValueError("only a dspark drafter has a SGLang DSPARK checkpoint format")
    late = [i for i in cfg.target_layer_ids if not 0 <= i <= num_target_layers - 2]
    if late:  # SGLang's Llama captures layer i's output as the input of layer i + 1
        raise ValueError(f"target layer ids {late} cannot be captured by SGLang: ids must lie in "
                         f"0..{num_target_layers - 2} for a {num_target_layers}-layer target")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": num_target_layers,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
    }


def untied_state(model: nn.Module, shared: SharedTarget | None) -> dict[str, torch.Tensor]:
    """The module's state with a tied Markov head replaced by its materialised untied weights."""
    state = dict(model.state_dict())
    head = getattr(model, "markov_head", None)
    if isinstance(head, TiedMarkovHead):
        if shared is None:
            raise ValueError("exporting a tied Markov head needs the target's embedding and lm_head (shared=)")
        state = {k: v for k, v in state.items() if not k.startswith("markov_head.")}
        state.update({f"markov_head.{k}": v for k, v in head.materialize(shared.embed, shared.lm_head).items()})
    return state


def export_state_dict(model: BlockDrafter, dtype: torch.dtype = torch.bfloat16,
                      shared: SharedTarget | None = None) -> dict[str, torch.Tensor]:
    """Module state with SGLang's names; the confidence head stays float32 (SGLang computes it in fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in untied_state(model, shared).items():
        keep32 = name.startswith("confidence_head.")
        out[name] = t.detach().to("cpu", torch.float32 if keep32 else dtype).contiguous()
    return out


def write_checkpoint(model: nn.Module, folder: Path, *, num_target_layers: int, temperatures: list[float] | None = None,
                     ece_before: list[float] | None = None, ece_after: list[float] | None = None,
                     sts_dataset: str = "", sts_samples: int = 0,
                     dtype: torch.dtype = torch.bfloat16, extra: dict[str, Any] | None = None,
                     shared: SharedTarget | None = None) -> Path:
    from dataclasses import replace

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg: DrafterConfig = model.cfg  # type: ignore[assignment]
    saved = replace(cfg, markov_tied=False)
    extra = {**(extra or {}), "trained_with_tied_markov_head": cfg.markov_tied}
    (folder / "kllm_drafter.json").write_text(json.dumps({"config": saved.to_dict(), **extra}, indent=1))
    if cfg.kind == "dspark":
        assert isinstance(model, BlockDrafter)
        (folder / "config.json").write_text(json.dumps(sglang_config(cfg, num_target_layers), indent=1))
        save_file(export_state_dict(model, dtype, shared), str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    if temperatures is not None:
        if len(temperatures) != cfg.block_size:
            raise ValueError("one temperature per block position is needed")
        # SGLang's DSparkStsCalibration fields (srt/speculative/dspark_components/dspark_sts.py)
        (folder / "dspark_sts.json").write_text(json.dumps({
            "temperatures": [float(t) for t in temperatures], "dataset": sts_dataset, "num_samples": int(sts_samples),
            "ece_before": [float(e) for e in ece_before or []], "ece_after": [float(e) for e in ece_after or []]}, indent=1))
    return folder


def load_drafter(folder: Path, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuild a drafter written by `write_checkpoint` (for the reference loop)."""
    from safetensors.torch import load_file

    meta = json.loads((folder / "kllm_drafter.json").read_text())
    model = build_drafter(DrafterConfig.from_dict(meta["config"]))
    state = load_file(str(folder / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.to(device)
