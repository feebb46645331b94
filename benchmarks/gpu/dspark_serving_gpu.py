"""GPU row of dspark: SGLang 0.5.23's own DSPARK speculative decoding on the kllm_cuda platform
(Triton attention, PyTorch sampling, no sgl-kernel), three setups up at once on one GPU:
no_spec (the target alone), dspark_stock (`--speculative-algorithm DSPARK`, SGLang's verify planner,
no SPS table) and dspark_plugin (the same server and environment plus `--enable-plugin dspark`).

Per repeat, context and batch the setups take turns (order alternating), each sent the same fresh
random prompts at once, streamed: TPOT, output tok/s and SGLang's accept length (meta_info). A server
that does not start (a DSPARK one is retried once without CUDA graphs) or dies, or a request that
fails, is recorded with the server log's tail and the run goes on; the JSON is rewritten as it goes.
`--drafter random` builds a small DSPARK checkpoint with random weights and a confidence head
(plugins/dspark/training/export.py); `--drafter PATH` serves a trained one. `--cpu-dry-run`: that
checkpoint for the tiny target through SGLang's draft-config parser and DSparkDraftModel loader on
CPU, then no_spec alone on kllm_cpu (SGLang refuses DSPARK on a CPU device).

    python benchmarks/gpu/dspark_serving_gpu.py --target tiny --out F.json [--cpu-dry-run]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_bench_common import Setup, header, log, spread, write  # noqa: E402
from serving_speed import ids  # noqa: E402

from kllm_plugins.bench.client import stream_generate  # noqa: E402
from kllm_plugins.bench.stats import ratio_of_medians  # noqa: E402

SETUPS = ("no_spec", "dspark_stock", "dspark_plugin")
PAIRS = (("dspark_plugin", "dspark_stock"), ("dspark_stock", "no_spec"), ("dspark_plugin", "no_spec"))
LOAD_CHECK = Path(HERE).parents[1] / "tests" / "sglang" / "dspark_load_check.py"
LOG_PATTERN = r"(?i)dspark|ragged.verify|sps table|kllm|Traceback|\w+(Error|Exception):"


class Target(Setup):
    """The served model (tiny, smollm2 or a folder) and its flags: bf16, Triton, on the GPU."""

    def __init__(self, cpu_dry_run: bool, target: str, graph_bs: int) -> None:
        self.cpu, self.name, self.graph_bs = cpu_dry_run, target, graph_bs
        if target == "tiny":
            from kllm_plugins.models.tiny_llama import tiny_llama_path
            path = tiny_llama_path()
        elif target == "smollm2":  # its GGUF joined by scripts/gpu/device_setup.sh, converted once
            from kllm_plugins.models.smollm2 import smollm2_path
            path = smollm2_path()
        else:
            path = Path(target)
        self.model = str(path)
        self.hf = json.loads((path / "config.json").read_text())
        self.vocab, self.max_pos = int(self.hf["vocab_size"]), int(self.hf.get("max_position_embeddings", 8192))

    def args(self, mem_fraction: float, graphs: bool = True, graph_bs: int = 0) -> list[str]:
        if self.cpu:
            return ["--dtype", "float32"]
        out = ["--dtype", "bfloat16", "--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--mem-fraction-static", str(mem_fraction), "--skip-tokenizer-init"]
        graph = ["--cuda-graph-max-bs-decode", str(graph_bs or self.graph_bs)] if graphs else ["--disable-cuda-graph"]
        return out + graph

    def model_name(self) -> str:
        return f"{self.name} (CPU dry run)" if self.cpu else f"{self.name} ({self.model}), bf16"


# -- the drafter ----------------------------------------------------------------------------
def build_random_drafter(target: Path, out: Path, *, layers: int = 2, block_size: int = 7,
                         markov_rank: int = 64) -> Path:
    """A DSPARK draft checkpoint in SGLang's format for `target`: random weights, a confidence head
    (ragged verify allowed) and identity STS temperatures. Built on the CPU in seconds."""
    import torch

    from kllm_plugins.plugins.dspark.core.drafters import build_drafter
    from kllm_plugins.plugins.dspark.core.target_llama import LlamaShape, default_target_layers
    from kllm_plugins.plugins.dspark.train import drafter_config
    from kllm_plugins.plugins.dspark.training.export import write_checkpoint

    hf = json.loads((target / "config.json").read_text())
    shape = LlamaShape.from_hf_config(hf)
    mask = int(hf.get("unk_token_id") or hf.get("pad_token_id") or 0)  # train.py's default mask token
    cfg = drafter_config("dspark", shape, layers=layers, block_size=block_size, mask_token_id=mask,
                         target_layers=default_target_layers(shape.num_layers, 3), markov_rank=markov_rank)
    torch.manual_seed(0)
    return write_checkpoint(build_drafter(cfg), out, num_target_layers=shape.num_layers,
                            temperatures=[1.0] * block_size, sts_dataset="none (random weights)",
                            extra={"random_weights": True})


def parse_check(draft: Path, target_vocab: int, target_layers: int) -> dict[str, Any]:
    """What SGLang's own parsers make of the draft config (the checks its DSPARK worker runs)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config, resolve_runtime_config

    cfg = json.loads((draft / "config.json").read_text())
    parsed = parse_dspark_draft_config(draft_hf_config=cfg)
    runtime = resolve_runtime_config(draft_hf_config=cfg, speculative_num_draft_tokens=None,
                                     target_vocab_size=target_vocab)
    layer_ids = parse_dflash_draft_config(draft_hf_config=cfg).resolve_target_layer_ids(target_num_layers=target_layers)
    return {"gamma": runtime.gamma, "verify_num_draft_tokens": runtime.verify_num_draft_tokens,
            "mask_token_id": runtime.mask_token_id, "markov_rank": parsed.markov_rank,
            "markov_head_type": parsed.markov_head_type, "target_layer_ids": layer_ids,
            "layers": parsed.num_hidden_layers}


def load_check(target: str, draft: Path) -> dict[str, Any]:
    """SGLang's DSparkDraftModel built from the checkpoint and loaded on CPU (tests/sglang's checker)."""
    env = {**os.environ, "SGLANG_PLATFORM": "kllm_cpu"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    proc = subprocess.run([sys.executable, str(LOAD_CHECK), target, str(draft)], capture_output=True, text=True,
                          timeout=600, env=env)
    lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "rc": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    got = json.loads(lines[0])
    got["ok"] = not got["missing"] and not got["unexpected"] and max(got["checks"].values()) < 1e-4
    return got


# -- servers ---------------------------------------------------------------------------------
def make_server(target: Target, setup: str, a: argparse.Namespace, draft: Path | None, graphs: bool) -> Any:
    extra = ["--max-running-requests", str(max(a.batches)), "--chunked-prefill-size", str(a.chunk)]
    env: dict[str, str] = {}
    if setup != "no_spec":
        assert draft is not None
        gamma = int(json.loads((draft / "config.json").read_text()).get("block_size", 7))
        extra += ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
                  "--speculative-dspark-block-size", str(gamma)]
        extra += [] if target.cpu else ["--speculative-draft-attention-backend", "triton"]
        if (draft / "dspark_sts.json").exists():
            extra += ["--speculative-dspark-confidence-sts-path", str(draft / "dspark_sts.json")]
        env["SGLANG_RAGGED_VERIFY_MODE"] = a.ragged_mode  # the same for both: only the plugin differs
    if setup == "dspark_plugin":
        env["KLLM_DSPARK_PUBLISH_INTERVAL_S"] = "0.2"
    pool = max(a.batches) * (max(a.contexts) + a.out_tokens + 64) + 4096
    return target.server(["dspark"] if setup == "dspark_plugin" else [], extra, env, pool, a.mem_fraction,
                         graphs=graphs, strict=True, name=setup if graphs else f"{setup}-eager")


def describe(srv: Any, graphs: bool) -> dict[str, Any]:
    env = {k: v for k, v in srv.env.items() if k.startswith(("SGLANG_", "KLLM_")) and k != "KLLM_RUN_DIR"}
    return {"args": srv.args[3:], "env": env, "graphs": graphs}


def log_lines(srv: Any) -> list[str]:
    return [ln for ln in srv.grep_log(LOG_PATTERN) if "Ignore import error" not in ln]


def failure(srv: Any, exc: BaseException) -> dict[str, Any]:
    """Why a server failed: the last error line of its log (else the exception's), and the log's tail."""
    tail = srv.log_tail(80)
    errors = [ln for ln in tail.splitlines() if re.search(r"\w+(Error|Exception)\b", ln)]
    return {"ok": False, "error": (errors[-1] if errors else str(exc).splitlines()[0])[:400], "log_tail": tail}


def start_each(servers: dict[str, Any], info: dict[str, dict[str, Any]]) -> None:
    """Start the servers at once; a failure is recorded in `info`, never raised."""
    from kllm_plugins.testing.sglang_server import start_each as start_concurrently

    t0 = time.perf_counter()
    for (setup, srv), exc in zip(servers.items(), start_concurrently(list(servers.values()))):
        if exc is None:
            info[setup].update(ok=True, group_up_s=round(time.perf_counter() - t0, 1))  # all started together
        else:
            info[setup].update(failure(srv, exc))
            srv.stop()
        info[setup]["log_lines"] = log_lines(srv)[:30]


def plugin_plans(srv: Any) -> dict[str, Any]:
    """The plugin's budget decisions so far, by source (model / explore / stock), per process."""
    try:
        procs = srv.get_json("/kllm/stats", timeout=5).get("dspark", {}).get("processes", {})
        return {pid: {"plans": d.get("plans"), "last": d.get("last")} for pid, d in procs.items()}
    except Exception as exc:  # noqa: BLE001 - informative only
        return {"error": repr(exc)[:200]}


# -- measurement -----------------------------------------------------------------------------
def run_batch(srv: Any, batch_prompts: list[list[int]], out_tokens: int, timeout_s: float) -> dict[str, Any]:
    def one(p: list[int]) -> tuple[float, float, dict[str, Any]]:
        return stream_generate(srv.base_url, p, out_tokens, timeout_s=timeout_s, ignore_eos=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch_prompts)) as pool:
        outs = list(pool.map(one, batch_prompts))
    wall = time.perf_counter() - t0
    tokens = [int(m.get("completion_tokens", 0)) for _, _, m in outs]
    if any(n != out_tokens for n in tokens):  # an error event or a cut stream: not a measurement
        raise RuntimeError(f"output tokens {sorted(set(tokens))}, expected {out_tokens} for each of {len(tokens)}")
    tpot = [1e3 * (e2e - ttft) / (n - 1) for (ttft, e2e, _), n in zip(outs, tokens)]
    row = {"wall_s": wall, "output_tok_s": sum(tokens) / wall, "tokens": sum(tokens),
           "tpot_ms": [round(x, 4) for x in tpot], "tpot_ms_median": statistics.median(tpot),
           "ttft_ms_median": 1e3 * statistics.median(t for t, _, _ in outs)}
    verify = [m.get("spec_verify_ct") for _, _, m in outs]
    if all(isinstance(v, int) and v > 0 for v in verify):  # SGLang reports it under speculation only
        row.update(verify_ct=sum(verify), accept_length=sum(tokens) / sum(verify))
    caps = [m["spec_cap_length"] for _, _, m in outs if "spec_cap_length" in m]
    if caps:
        row["cap_length_mean"] = statistics.fmean(caps)
    return row


def paired(ours: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Ratio of medians over the repeats both setups measured (spread: the per-repeat ratios)."""
    o, b = {r["repeat"]: r[key] for r in ours}, {r["repeat"]: r[key] for r in base}
    both = sorted(set(o) & set(b))
    if both:
        return ratio_of_medians([o[k] for k in both], [b[k] for k in both], paired=True)
    return ratio_of_medians(list(o.values()), list(b.values()), paired=False)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (context, batch): each setup's figures, the ratios plugin/stock and each/no_spec, the targets."""
    cells: dict[str, Any] = {}
    for ctx, batch in sorted({(r["context"], r["batch"]) for r in rows}):
        got = {s: [r for r in rows if (r["context"], r["batch"], r["setup"]) == (ctx, batch, s) and "wall_s" in r]
               for s in SETUPS}
        cell: dict[str, Any] = {}
        for s, rs in got.items():
            if rs:
                tp = [x for r in rs for x in r["tpot_ms"]]
                cell[s] = {"tpot_ms_median": statistics.median(tp), "tpot_ms_mean": statistics.fmean(tp),
                           "output_tok_s": spread([r["output_tok_s"] for r in rs]), "repeats": len(rs)}
                if all("verify_ct" in r for r in rs):
                    cell[s]["accept_length"] = sum(r["tokens"] for r in rs) / sum(r["verify_ct"] for r in rs)
                caps = [r["cap_length_mean"] for r in rs if "cap_length_mean" in r]
                if caps:
                    cell[s]["cap_length_mean"] = statistics.fmean(caps)
        ratios: dict[str, Any] = {}
        for ours, base in PAIRS:
            o, b = got[ours], got[base]
            if o and b:
                ratios[f"{ours}/{base}"] = {"tpot_median": paired(o, b, "tpot_ms_median"),
                                            "output_tok_s": paired(o, b, "output_tok_s"),
                                            "tpot_mean": cell[ours]["tpot_ms_mean"] / cell[base]["tpot_ms_mean"]}
        pvs = ratios.get("dspark_plugin/dspark_stock")
        targets = {"plugin_tpot_median_le_stock": None if pvs is None else pvs["tpot_median"]["ratio"] <= 1.0,
                   "plugin_tpot_mean_le_stock": None if pvs is None else pvs["tpot_mean"] <= 1.0}
        for s in SETUPS[1:]:
            r = ratios.get(f"{s}/no_spec")
            targets[f"{s}_tok_s_ge_no_spec"] = None if r is None else r["output_tok_s"]["ratio"] >= 1.0
        cells[f"ctx{ctx}/bs{batch}"] = {**cell, "ratios": ratios, "targets": targets}
    return cells


def print_table(cells: dict[str, Any]) -> None:
    """One line per cell: each setup's TPOT median [mean] and tok/s, the ratios, the accept lengths."""
    def fig(x: Any, unit: str = "") -> str:
        x = x.get("median", x.get("ratio")) if isinstance(x, dict) else x
        return "-" if x is None else f"{x:.3g}{unit}"

    names = [f"{o}/{b}" for o, b in PAIRS]
    log("dspark", "cell | TPOT ms median [mean]: " + " / ".join(SETUPS) + " | tok/s: the same | "
        + " | ".join(f"{n}: TPOT, tok/s" for n in names) + " | accept length: stock / plugin")
    for name, c in cells.items():
        g, r = [c.get(s, {}) for s in SETUPS], [c["ratios"].get(n, {}) for n in names]
        log("dspark", f"{name} | " + " / ".join(f"{fig(x.get('tpot_ms_median'))} [{fig(x.get('tpot_ms_mean'))}]"
                                                for x in g)
            + " | " + " / ".join(fig(x.get("output_tok_s")) for x in g)
            + " | " + " | ".join(f"{fig(x.get('tpot_median'), 'x')}, {fig(x.get('output_tok_s'), 'x')}" for x in r)
            + " | " + " / ".join(fig(x.get("accept_length")) for x in g[1:]))


def prepare_drafter(a: argparse.Namespace, target: Target, res: dict[str, Any]) -> Path | None:
    res["draft"] = {"kind": a.drafter}
    try:
        t0 = time.perf_counter()
        draft = (build_random_drafter(Path(target.model), Path(tempfile.mkdtemp(prefix="dspark-draft-")),
                                      layers=a.draft_layers, block_size=a.block_size)
                 if a.drafter == "random" else Path(a.drafter))
        res["draft"].update(folder=str(draft), build_s=round(time.perf_counter() - t0, 1),
                            config=json.loads((draft / "config.json").read_text()))
        if a.cpu_dry_run:
            res["draft"]["parse_check"] = parse_check(draft, target.vocab, int(target.hf["num_hidden_layers"]))
            res["draft"]["load_check"] = load_check(target.model, draft)
        log("dspark", f"drafter: {json.dumps({k: v for k, v in res['draft'].items() if k != 'config'})[:700]}")
        return draft
    except Exception as exc:  # noqa: BLE001 - without a drafter only no_spec runs
        res["draft"]["error"] = repr(exc)[:1000]
        log("dspark", f"drafter failed: {exc!r}; DSPARK setups skipped")
        return None


def serve_and_measure(a: argparse.Namespace, target: Target, draft: Path | None, graphs: bool,
                      lengths: dict[int, int], servers: dict[str, Any], res: dict[str, Any], t_start: float) -> None:
    info = res["servers"]
    t0 = time.perf_counter()
    start_each(servers, info)
    retry = [s for s in servers if s != "no_spec" and not info[s]["ok"] and graphs and not a.no_eager_fallback]
    for s in retry:  # DSPARK's graph paths have never run on kllm_cuda: once more, eager
        servers[s] = make_server(target, s, a, draft, False)
        info[s] = {"first_attempt_with_graphs": info[s], **describe(servers[s], False)}
    start_each({s: servers[s] for s in retry}, info)
    live = [s for s in servers if info[s]["ok"]]
    log("dspark", f"servers up in {time.perf_counter() - t0:.0f} s: {live}; failed: "
        f"{ {s: info[s]['error'] for s in servers if s not in live} }")
    write(a.out, res)

    def measure(s: str, ps: list[list[int]], out_tokens: int, row: dict[str, Any]) -> None:
        try:
            row.update(run_batch(servers[s], ps, out_tokens, a.request_timeout_s))
            if s == "dspark_plugin":
                row["plugin_plans"] = plugin_plans(servers[s])
        except Exception as exc:  # noqa: BLE001 - recorded; a server that died leaves the run
            row["error"] = repr(exc)[:500]
            proc = servers[s].proc
            if proc is None or proc.poll() is not None:
                info[s].update(failure(servers[s], exc), exited=proc and proc.returncode)
                live.remove(s)

    for s in list(live):  # warm-up: Triton kernels at the run's shapes; the plugin's cost model starts learning
        for n, length, out in ((max(a.batches), 32, 16), (1, max(lengths.values()), 8)):
            warm: dict[str, Any] = {}
            if s in live:
                measure(s, ids(n, length, f"warm/{s}/{length}", target.vocab), out, warm)
            if "error" in warm:
                info[s]["warm_up_error"] = warm["error"]
    for k, (rep, ctx, batch) in enumerate(itertools.product(range(a.repeats), a.contexts, a.batches)):
        ps = ids(batch, lengths[ctx], f"{rep}/{ctx}/{batch}", target.vocab)  # the same for every setup
        for s in list(live if k % 2 == 0 else live[::-1]):
            row: dict[str, Any] = {"setup": s, "context": ctx, "batch": batch, "repeat": rep}
            if a.deadline_s and time.perf_counter() - t_start > a.deadline_s:
                row["skipped"] = "deadline"
            else:
                measure(s, ps, a.out_tokens, row)
            res["rows"].append(row)
            res["metrics"] = summarize(res["rows"])
            write(a.out, res)
            log("dspark", f"{s} ctx {ctx} bs {batch} rep {rep}: " + (
                f"TPOT {row['tpot_ms_median']:.2f} ms, {row['output_tok_s']:.0f} tok/s, accept "
                f"{row.get('accept_length', '-')}" if "wall_s" in row else row.get("error") or row["skipped"]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny", help="tiny | smollm2 | a Hugging Face Llama folder")
    ap.add_argument("--drafter", default="random", help="random (built here) | a DSPARK draft checkpoint folder")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=7, help="gamma of the random drafter")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192],
                    help="prompt tokens (clipped to the target's positions)")
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--ragged-mode", default="compact", choices=("compact", "cap-accept", "static"),
                    help="SGLANG_RAGGED_VERIFY_MODE of both DSPARK servers (static: no planning, the plugin is inert)")
    ap.add_argument("--mem-fraction", type=float, default=0.25, help="per server; the servers share the GPU")
    ap.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    ap.add_argument("--no-graphs", action="store_true", help="every server eager (--disable-cuda-graph)")
    ap.add_argument("--no-eager-fallback", action="store_true", help="no eager retry of a DSPARK server that failed")
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--deadline-s", type=float, default=420.0, help="no measurement starts after this (0: none)")
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t_start = time.perf_counter()
    if a.cpu_dry_run:  # DSPARK refuses a CPU device: the draft checks and no_spec only
        a.target, a.batches, a.contexts, a.out_tokens, a.repeats, a.setups = "tiny", [1, 4], [64], 16, 1, ["no_spec"]
    target = Target(a.cpu_dry_run, a.target, max(a.batches))
    spare = a.out_tokens + a.block_size + 1 + 16  # the output, a verify window and a margin stay inside the positions
    lengths = {c: min(c, target.max_pos - spare) for c in a.contexts}
    graphs = not (a.no_graphs or a.cpu_dry_run)
    res = header("benchmarks/gpu/dspark_serving_gpu.py", "python " + " ".join(sys.argv), target,
                 {**{k: getattr(a, k) for k in ("target", "drafter", "setups", "batches", "contexts", "out_tokens",
                                                "repeats", "ragged_mode", "mem_fraction", "chunk")},
                  "prompt_tokens": lengths, "graphs": graphs, "temperature": 0, "ignore_eos": True})
    res["notes"] = [
        "TPOT per request = (end - first streamed token) / (completion_tokens - 1); output tok/s = tokens of a batch / "
        "its wall time (sent at once, prefill included); ratios: ratio_of_medians over the repeats (spread: per-repeat "
        "ratios), tpot_mean: ratio of pooled means; accept length = sum(completion_tokens) / sum(spec_verify_ct)",
        f"dspark_stock: SGLANG_RAGGED_VERIFY_MODE={a.ragged_mode} and no --speculative-dspark-sps-table-path, so "
        "SGLang's planner has a flat SPS table (compact: verify-all); dspark_plugin: the same, plugin enabled",
        "prompt lengths are clipped so that prompt + output + a verify window fit the target's positions"]
    if a.drafter == "random":
        res["notes"].append("random drafter: acceptance ~0, so speculation pays draft and verify for no accepted token "
                            "(the speedup-collapse case): a legitimate first row, a floor for the spec/no_spec ratios")
    res.update(servers={}, rows=[], metrics={})
    draft = prepare_drafter(a, target, res)
    if draft is None:
        a.setups = [s for s in a.setups if s == "no_spec"]
    servers = {s: make_server(target, s, a, draft, graphs) for s in a.setups}
    info: dict[str, dict[str, Any]] = {s: describe(srv, graphs) for s, srv in servers.items()}
    res["servers"] = info
    write(a.out, res)
    try:
        serve_and_measure(a, target, draft, graphs, lengths, servers, res, t_start)
    finally:
        for srv in servers.values():
            srv.stop()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    flags = [(k, v) for c in res["metrics"].values() for k, v in c["targets"].items() if v is not None]
    res["targets"] = {k: all(v for kk, v in flags if kk == k) for k in dict(flags)}  # over the cells measured
    write(a.out, res)
    print_table(res["metrics"])
    log("dspark", f"targets over every cell measured: {json.dumps(res['targets'])}")
    log("dspark", f"wrote {a.out} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
