"""Benchmark helper (CPU, after a GPU run): the issue-shaped summary of one drafter evaluation.

Reads the pipeline's merged `dspark_gpu.json` (from the returned bundle.tar: out/dspark_gpu.json)
and writes a JSON with: the drafters in the issue's shape (kind, accept_len, tokens/s at batch 1
and 16, ECE) plus what the targets are judged on: accept length per position and the conditional
acceptance P(k | k-1), verify tokens, the validation learning curves and how flat their last
stretch is, the seed spread of every drafter trained with two seeds, and the ratios against the
targets (seed means where there are two seeds, and the worst / best seed pairing).

    python benchmarks/dspark/summarize_run.py /tmp/dsp5/out/dspark_gpu.json --out /tmp/dsp5/run5.json \
        --command "..." --label run5
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TARGETS = {"dspark_vs_dflash": 1.15, "dspark_vs_eagle": 1.25, "ece": 0.05}
# a drafter and its second seed (the seed spread); the first name is the one the targets name
SEED_PAIRS = {"dspark": ("dspark", "dspark_seed1"), "dflash": ("dflash", "dflash_seed1"),
              "dspark_rnn": ("dspark_rnn", "dspark_rnn_seed1"),
              "dspark_untied": ("dspark_untied", "dspark_untied_seed1")}


def conditional(rates: list[float]) -> list[float]:
    """P(draft k accepted | drafts < k accepted) from P(at least k accepted)."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return out


def flatness(curve: list[dict]) -> dict:
    """Relative change of the validation accept length over the curve's last two intervals."""
    vals = [(c["progress"], c["step"], c["val"]) for c in curve]
    res: dict = {"points": [[round(p, 4), s, round(v, 4)] for p, s, v in vals]}
    if len(vals) >= 3:
        (p1, _, v1), (p2, _, v2), (p3, _, v3) = vals[-3:]
        res["gain_last_interval"] = round(v3 / v2 - 1.0, 4)
        res["gain_previous_interval"] = round(v2 / v1 - 1.0, 4)
        res["gain_per_10pct_time_last"] = round((v3 / v2 - 1.0) / max(1e-9, (p3 - p2) * 10), 4)
        res["best_progress"] = max(vals, key=lambda x: x[2])[0]
    return res


def drafter_row(name: str, e: dict) -> dict:
    loop = e.get("ece_loop", {})
    rates = e.get("accept_rate_per_position", [])
    return {
        "kind": e.get("kind"), "name": name, "seed": e.get("seed"), "markov_head_type": e.get("markov_head_type"),
        "accept_len": round(e["accept_len"], 4) if "accept_len" in e else None,
        "accept_len_walk_test": round(e["accept_len_walk_test"], 4) if "accept_len_walk_test" in e else None,
        "tokens_per_s_bs1": e.get("tokens_per_s_bs1"), "tokens_per_s_bs16": e.get("tokens_per_s_bs16"),
        "ece": loop.get("temperature_bias_in_loop", {}).get("pooled"),
        "ece_temperature_only": loop.get("sts_in_loop", {}).get("pooled"),
        "ece_raw": loop.get("raw", {}).get("pooled"),
        "accept_rate_per_position": [round(r, 4) for r in rates],
        "accept_conditional_per_position": [round(r, 4) for r in conditional(rates)],
        "accept_len_sampling_t1": e.get("accept_len_sampling_t1"),
        # run 7 on: accept_len is at eval_temperature (1.0), the greedy figures are secondary
        "eval_temperature": e.get("eval_temperature", 0.0), "accept_len_greedy": e.get("accept_len_greedy"),
        "greedy_accept_rate_per_position": (e.get("greedy") or {}).get("accept_rate_per_position"),
        "loss": e.get("loss"),
        "verify_tokens": e.get("verify_tokens"), "verify_tokens_per_accepted_token": e.get("verify_tokens_per_accepted_token"),
        "parameters": e.get("parameters"), "train_steps": e.get("train_steps"), "train_seconds": e.get("train_seconds"),
        "learning_curve": flatness(e.get("learning_curve", [])),
    }


def summarize(gpu: dict) -> dict:
    rows = {n: drafter_row(n, e) for n, e in gpu["drafters"].items() if "accept_len" in e}
    acc = {n: r["accept_len"] for n, r in rows.items()}

    def seeds(base: str) -> list[float]:
        return [acc[n] for n in SEED_PAIRS.get(base, (base,)) if n in acc]

    spread = {b: {"values": seeds(b), "spread_rel": round(max(seeds(b)) / min(seeds(b)) - 1.0, 4)}
              for b in SEED_PAIRS if len(seeds(b)) == 2}
    ratios: dict = {"targets": TARGETS}
    for ds in ("dspark", "dspark_rnn", "dspark_untied"):
        if not seeds(ds):
            continue
        for base in ("dflash", "dflash6", "eagle"):
            if not seeds(base):
                continue
            a, b = seeds(ds), seeds(base)
            target = TARGETS["dspark_vs_eagle" if base == "eagle" else "dspark_vs_dflash"]
            ratios[f"{ds}_vs_{base}"] = {
                "mean_of_seeds": round(statistics.mean(a) / statistics.mean(b), 4),
                "worst_pairing": round(min(a) / max(b), 4), "best_pairing": round(max(a) / min(b), 4),
                "met": statistics.mean(a) / statistics.mean(b) >= target}
    ece = {n: r["ece"] for n, r in rows.items() if r["ece"] is not None}
    ratios["ece_met"] = {n: v <= TARGETS["ece"] for n, v in ece.items()}
    pos: dict = {}
    if "dspark" in rows and "dflash" in rows:
        pos = {"conditional_dspark": rows["dspark"]["accept_conditional_per_position"],
               "conditional_dflash": rows["dflash"]["accept_conditional_per_position"]}
        for extra in ("dspark_seed1", "dflash_seed1", "dspark_rnn", "dspark_untied", "dflash6"):
            if extra in rows:
                pos[f"conditional_{extra}"] = rows[extra]["accept_conditional_per_position"]
    return {"target": gpu.get("target"), "device": gpu.get("device"), "gamma": gpu.get("gamma"),
            "drafters": list(rows.values()), "ratios": ratios, "seed_spread": spread, "per_position": pos,
            "target_alone": gpu.get("target_alone"), "fp32_losslessness": gpu.get("fp32_losslessness"),
            "draft_costs_context256": gpu.get("draft_costs_context256"),
            "step_costs_context256": gpu.get("step_costs_context256")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gpu_json", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    res = summarize(json.loads(a.gpu_json.read_text()))
    res = {"command": a.command, **res}
    a.out.write_text(json.dumps(res, indent=1))
    for r in res["drafters"]:
        print(f"{r['name']:>16} acc {r['accept_len']} walk {r['accept_len_walk_test']} bs1 {r['tokens_per_s_bs1']} "
              f"bs16 {r['tokens_per_s_bs16']} ece {r['ece']} steps {r['train_steps']} curve {r['learning_curve']}")
    print(json.dumps(res["ratios"]), json.dumps(res["seed_spread"]))
    print(json.dumps(res["per_position"]))


if __name__ == "__main__":
    main()
