"""Shared pieces of the GPU plugin benchmarks (benchmarks/gpu/*_gpu.py): the random-weight model
of Llama-3.1-8B's shape (SGLang `--load-format dummy`, nothing downloaded), SGLang servers on the
kllm_cuda platform, and small JSON summaries written as the run goes (the device call can be cut
at its limit; what was measured is kept).

Every driver also runs as a CPU dry run (`--cpu-dry-run`): the tiny test model on the kllm_cpu
platform at small sizes, so its logic is checked before device time is spent.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kllm_plugins.bench.stats import spread  # noqa: F401  (re-exported for the drivers)
from serving_speed import LLAMA_8B  # noqa: F401  (the one definition of the shape)

GPU_ENV = {"SGLANG_PLATFORM": "kllm_cuda", "KLLM_CUDA_GRAPHS": "1"}


def llama8b_folder(max_positions: int = 8192, **overrides: int) -> Path:
    """A config-only folder of Llama-3.1-8B's shape (bf16), with `max_positions` of RoPE; `overrides`
    replace config keys (e.g. num_hidden_layers=1 where only the scheduler's cost per pass matters)."""
    folder = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "max_position_embeddings": max_positions, **overrides}))
    return folder


class Setup:
    """Model and server flags of one benchmark: the 8B-shaped random bf16 model on the GPU, or the
    tiny model on the CPU platform (dry run)."""

    def __init__(self, cpu_dry_run: bool, max_positions: int = 8192, **shape: int) -> None:
        self.cpu = cpu_dry_run
        self.shape = shape
        if cpu_dry_run:
            from kllm_plugins.models.tiny_llama import tiny_llama_path

            self.model = str(tiny_llama_path())
            self.vocab = 4000
        else:
            self.model = str(llama8b_folder(max_positions, **shape))
            self.vocab = LLAMA_8B["vocab_size"]

    def args(self, mem_fraction: float, graphs: bool = True, graph_bs: int = 32) -> list[str]:
        if self.cpu:
            return ["--dtype", "float32"]
        out = ["--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--mem-fraction-static", str(mem_fraction), "--skip-tokenizer-init"]
        return out + (["--cuda-graph-max-bs-decode", str(graph_bs)] if graphs else ["--disable-cuda-graph"])

    def env(self, graphs: bool = True) -> dict[str, str]:
        if self.cpu:
            return {}
        return {**GPU_ENV, "KLLM_CUDA_GRAPHS": "1" if graphs else "0"}

    def server(self, plugins: Sequence[str], extra: Sequence[str], env: dict[str, str], max_total_tokens: int,
               mem_fraction: float, graphs: bool = True, strict: bool = True, name: str = "") -> Any:
        """`name`: with KLLM_SERVER_LOG_DIR set (the device suite sets it to its output folder), the
        server's log is written there as server-<name>.log and comes back with the call."""
        from kllm_plugins.testing.sglang_server import SGLangServer

        log_dir = os.environ.get("KLLM_SERVER_LOG_DIR")
        log_path = os.path.join(log_dir, f"server-{name}.log") if log_dir and name else None
        return SGLangServer(self.model, plugins=list(plugins), extra_args=[*self.args(mem_fraction, graphs), *extra],
                            env={**self.env(graphs), **env}, cpu_platform=self.cpu, max_total_tokens=max_total_tokens,
                            startup_timeout_s=600 if self.cpu else 420, strict=strict,
                            log_path=log_path)

    def machine(self) -> dict[str, Any]:
        if self.cpu:
            return {"cpu_dry_run": True, "note": "shared 2-core CPU machine, several helpers (dry run, not a figure)"}
        import torch

        return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
                "shared": False, "note": "lent GPU machine, one job at a time; sglang 0.5.23 on kllm_cuda "
                "(Triton attention, PyTorch sampling, no sgl-kernel/FlashInfer)"}

    def model_name(self) -> str:
        if self.cpu:
            return "tiny-llama (CPU dry run)"
        return "llama-3.1-8b-shape-random-bf16" + "".join(f", {k}={v}" for k, v in sorted(self.shape.items()))


def wrapper_args(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, list[str], list[str]]:
    """For a driver that wraps a CPU benchmark: a parser holding the common options (`--cpu-dry-run`,
    `--mem-fraction`, `--out-root`), the driver's own arguments, and those after `--` (the wrapped
    benchmark's)."""
    argv = list(argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--mem-fraction", type=float, default=0.4)
    ap.add_argument("--out-root", default="", help="results under <this>/benchmarks/results (default: the repository)")
    return ap, ours, rest


def header(benchmark: str, command: str, setup: Setup, settings: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": benchmark, "command": command, "commit": os.environ.get("KLLM_COMMIT", "unknown"),
            "machine": setup.machine(), "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "model": setup.model_name(), "settings": settings, "metrics": {}}


def write(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, path)


def log(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
