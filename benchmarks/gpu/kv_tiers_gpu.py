"""GPU row of kv_tiers: benchmarks/kv_tiers/bench_tiers.py (L1 only vs stock HiCache vs kv_tiers with
host L2 and an L3 file store on the machine's disk; hit rate per tier, TTFT, throughput at a TTFT SLO
under open-loop load, the no-reuse control) with its servers on the GPU: the 8B-shaped random bf16
model on kllm_cuda, CUDA graphs on, two servers per setup sharing the GPU (`--mem-fraction` each).
Stock HiCache runs SGLang's default host layout (layer_first) with the `direct` I/O backend (its
`kernel` backend needs sgl-kernel, absent here); the kv_tiers setups run `--tiers-layout`
(page_first_direct by default: the plugin's staged L1<->L2 copier replaces the per-page copies).

Every argument after `--` goes to bench_tiers.py; the defaults below size the trace for the GPU
(8K-token shared contexts in 16-token blocks, a 16K-token L1 per server; rates 1 and 2 req/s:
8K-token prefills take about 1 s each on the Triton backend, and 4 req/s overloaded two servers in
the first run). The summary goes to
`<--results-root>/benchmarks/results/kv_tiers/<--results-name>.json` (on the device: $OUT).

    python benchmarks/gpu/kv_tiers_gpu.py --out-root $OUT -- --repeats 2 [--cpu-dry-run]
"""
from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "kv_tiers"))
from gpu_bench_common import Setup, wrapper_args  # noqa: E402

GPU_DEFAULTS = ["--l1-tokens", "16384", "--system-blocks", "512", "--user-blocks", "32", "--answer-blocks", "8",
                "--sessions", "8", "--turns", "3", "--rates", "1,2", "--slo-s", "2.0", "--server-threads", "0",
                "--results-name", "gpu_tiers", "--traces", "unique,synthetic"]


def main() -> int:
    ap, ours, rest = wrapper_args(sys.argv[1:])  # --out-root: bench_tiers --results-root
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--tiers-layout", default="page_first_direct", choices=["page_first_direct", "layer_first"],
                    help="HiCache host layout of the kv_tiers setups (page_first_direct engages the plugin's "
                         "staged L1<->L2 copier; stock HiCache keeps SGLang's default layer_first)")
    a = ap.parse_args(ours)
    import bench_tiers

    setup = Setup(a.cpu_dry_run, max_positions=65536)

    def gpu_server(plugins: list[str], extra: list[str], env: dict[str, str], l1_tokens: int, tag: str) -> Any:
        if "kv_tiers" in plugins:
            extra = [a.tiers_layout if x == "layer_first" else x for x in extra]
        return setup.server(plugins, ["--page-size", "16", "--chunked-prefill-size", str(a.chunk), *extra], env,
                            l1_tokens, a.mem_fraction, graphs=True, strict=True, name=f"kv_tiers-{tag}")

    if not setup.cpu:
        import bench_report

        bench_tiers.SERVER_FACTORY = gpu_server
        bench_report.MACHINE = f"{setup.machine()['gpu']}, lent machine, one job at a time"
        bench_report.SHARED = None
        bench_report.LABEL = (f"REAL SGLang servers on the {setup.machine()['gpu']} (kllm_cuda, CUDA graphs, Triton attention), "
                              f"{setup.model_name()}, kv_tiers layout {a.tiers_layout}")
    merged = [] if setup.cpu else list(GPU_DEFAULTS)  # an option given after `--` comes later and wins
    if a.out_root:
        merged += ["--results-root", a.out_root]
    sys.argv = [os.path.join(os.path.dirname(HERE), "kv_tiers", "bench_tiers.py"), *merged, *rest]
    bench_tiers.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
