"""GPU time-to-serve: benchmarks/bigpd_router/bench_time_to_serve.py with its servers on the H200
(kllm_cuda platform, CUDA graphs on): the Llama-3.1-8B-shaped random bf16 model (`--load-format
dummy`: the weights are initialised on the GPU, not read from disk, so "model_load" here is
allocation and initialisation of 16 GB, not a disk read), cold (page cache dropped: Python's imports
come from disk), warm, and standby promotion, plus the probes (`remote_instance`: a second server
loading the weights from the first over NCCL on the same GPU; `release`: release/resume of memory
occupation). Each server takes `--mem-fraction` of the GPU so that the probe's two fit.

The summary goes to `<--out-root>/benchmarks/results/bigpd_router/gpu_time_to_serve.json` (on the
device: $OUT). Arguments after `--` go to bench_time_to_serve.py.

    python benchmarks/gpu/time_to_serve_gpu.py --out-root $OUT -- --repeats 2 --paths cold standby
    python benchmarks/gpu/time_to_serve_gpu.py -- --paths warm --from-log <the device run's time_to_serve.log>
    python benchmarks/gpu/time_to_serve_gpu.py --cpu-dry-run --out-root /tmp/tts -- --repeats 1 --paths warm standby --probes
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bigpd_router"))
from gpu_bench_common import Setup, wrapper_args  # noqa: E402

MODEL = "llama8b"


def main() -> int:
    ap, ours, rest = wrapper_args(sys.argv[1:])
    a = ap.parse_args(ours)
    import bench_time_to_serve as tts

    setup = Setup(a.cpu_dry_run)
    from_log = "--from-log" in rest  # a device run's printed rows, recorded here (no GPU to name)
    tts.RESULT_NAME = "gpu_time_to_serve"
    tts.RESULTS_ROOT = Path(a.out_root) if a.out_root else None
    tts.MODELS = {MODEL: lambda: setup.model}
    tts.ENV = {"SGLANG_PLATFORM": "kllm_cpu"} if setup.cpu else dict(setup.env())
    tts.ARGS = [*setup.args(a.mem_fraction), "--max-total-tokens", "4096"]
    if not setup.cpu:
        # --skip-tokenizer-init (no tokenizer in the config-only folder): the request carries token ids
        tts.BODY = {"input_ids": list(range(100, 132)), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        tts.LABEL = f"REAL SGLang servers on the {setup.machine()['gpu']} (kllm_cuda)"
        tts.SHARED = None
        gpu = "NVIDIA H200 (rows from the device run's log)" if from_log else setup.machine()["gpu"]
        tts.MACHINE = f"{gpu}, lent machine, one job at a time"
        tts.PLATFORM_NOTE = ("Real SGLang 0.5.23 servers on one H200 (kllm_cuda platform, CUDA graphs on, Triton "
                             f"attention) behind kllm-router, {setup.model_name()} (--load-format dummy: weights "
                             "initialised on the GPU, not read from disk)")
        if from_log:
            tts.PLATFORM_NOTE += ("; recorded with --from-log from the rows a device run printed (that run was "
                                  "cut at its step limit before its first repeat ended and recorded)")
    else:
        tts.LABEL = "CPU DRY RUN of the GPU driver (not a figure)"
        tts.PLATFORM_NOTE = "CPU dry run of benchmarks/gpu/time_to_serve_gpu.py (tiny model; not a figure)"
    sys.argv = [os.path.join(os.path.dirname(HERE), "bigpd_router", "bench_time_to_serve.py"), "--models", MODEL, *rest]
    tts.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
