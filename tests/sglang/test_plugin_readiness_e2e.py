"""End to end: an enabled plugin either works or says why, and the CPU platform refuses in one
line what it cannot serve, before any model loads.

- One real server with every plugin enabled and no flag that turns on what they attach to (only
  `--enable-plugin`, plus a small chunk so a prompt is prefilled in several chunks): the inert
  ones (kv_tiers, dspark, ring_cp, bigpd_router) each log one warning naming the flags they need
  and show `inert: <reason>` in /kllm/plugins; incr_prefix selects its radix-cache backend itself
  and its counters move, as trace's do.
- Under KLLM_STRICT=1 each inert plugin stops start-up with one line (no traceback, no weights
  loaded); the CPU platform does the same for `--hicache-mem-layout page_head` and for
  `--enable-plugin ring_cp --attn-cp-size 2`.
- Stock `--enable-hierarchical-cache` with its default I/O backend and layout (kernel,
  page_first) serves on the CPU platform, outputs unchanged.

The other plugins' documented minimal commands are exercised, counters asserted, by their own
e2e tests: trace (test_host_e2e), fair_sched (test_fair_sched_e2e), kv_tiers (the
test_kv_tiers_*_e2e servers, started with kllm_plugins.plugins.kv_tiers.testing.l3_args), bigpd_router
(test_bigpd_router_e2e, PD over Mooncake); dspark and ring_cp need CUDA (tests/gpu).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from kllm_plugins.plugins.kv_tiers.testing import flush
from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

INERT = {
    "kv_tiers": "--enable-hierarchical-cache",
    "dspark": "--speculative-algorithm DSPARK",
    "ring_cp": "--enable-prefill-cp",
    "bigpd_router": "--disaggregation-mode prefill|decode",
}
ACTIVE = ["trace", "incr_prefix", "fair_sched"]
CHUNK = 64


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[SGLangServer]:
    plugins = [*ACTIVE, *INERT]
    with SGLangServer(tiny_model_path, plugins=plugins, strict=False, startup_timeout_s=420,
                      extra_args=["--chunked-prefill-size", str(CHUNK), "--dtype", "float32"]) as srv:
        yield srv


@pytest.mark.parametrize("name", sorted(INERT))
def test_inert_plugin_warns_once_and_shows_inert(server: SGLangServer, name: str) -> None:
    lines = server.grep_log(rf"kllm: plugin '{name}' is enabled but inert: ")
    assert len(lines) == 1, lines  # once, in the launcher (the only process that sees the arguments)
    assert INERT[name] in lines[0]
    state = server.get_json("/kllm/plugins")["state"]
    assert state[name].startswith("inert: ") and INERT[name] in state[name]


def _totals(server: SGLangServer, plugin: str) -> dict[str, float]:
    return server.get_json("/kllm/stats").get(plugin, {}).get("total", {})


def _wait_totals(server: SGLangServer, plugin: str, key: str, above: float, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = _totals(server, plugin)
        if got.get(key, 0) > above or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def test_incr_prefix_selects_its_backend_and_its_counters_move(server: SGLangServer) -> None:
    assert server.grep_log(r"kllm: incr_prefix: selected --radix-cache-backend kllm_incremental")
    state = server.get_json("/kllm/plugins")["state"]
    assert all(state[name] == "active" for name in ACTIVE), state
    before_incr = _totals(server, "incr_prefix").get("tail_inserts", 0)
    before_trace = _totals(server, "trace").get("prefill_chunks", 0)
    prompt = list(range(500, 500 + 5 * CHUNK))  # fresh, five chunks
    out = server.generate(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
    assert len(out["output_ids"]) == 4
    assert _wait_totals(server, "incr_prefix", "tail_inserts", before_incr)["tail_inserts"] > before_incr
    assert _wait_totals(server, "trace", "prefill_chunks", before_trace)["prefill_chunks"] >= before_trace + 5


def _launch(model: Path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLLM_") and k != "SGLANG_USE_CPU_ENGINE"}
    env.update({"SGLANG_PLATFORM": "kllm_cpu", "KLLM_STRICT": "1"})
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert "Load weight" not in text and "Loading safetensors" not in text  # stopped before the model loads
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("name", sorted(INERT))
def test_strict_mode_refuses_an_inert_plugin_before_the_model_loads(tiny_model_path: Path, name: str) -> None:
    line = _one_error_line(_launch(tiny_model_path, "--enable-plugin", name))
    assert f"KLLM_STRICT=1 and plugin '{name}' would do nothing: " in line and INERT[name] in line


def test_cpu_platform_refuses_a_hicache_layout_it_cannot_copy(tiny_model_path: Path) -> None:
    line = _one_error_line(_launch(tiny_model_path, "--enable-hierarchical-cache", "--hicache-ratio", "2",
                                   "--hicache-mem-layout", "page_head"))
    assert "kllm_cpu platform" in line and "page_head" in line
    assert "--hicache-io-backend kernel --hicache-mem-layout page_first" in line


def test_cpu_platform_refuses_context_parallelism(tiny_model_path: Path) -> None:
    line = _one_error_line(_launch(tiny_model_path, "--enable-plugin", "ring_cp", "--attn-cp-size", "2"))
    assert "kllm_cpu platform: --attn-cp-size 2 is not supported" in line and "torch_native" in line


def test_default_hicache_flags_serve_on_the_cpu(tiny_model_path: Path) -> None:
    # the default --hicache-io-backend kernel --hicache-mem-layout page_first: the first L2 write
    # used to raise NameError (transfer_kv_all_layer_lf_pf) in the scheduler
    args = ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--page-size", "16", "--dtype", "float32"]
    with SGLangServer(tiny_model_path, plugins=["trace"], extra_args=args, max_total_tokens=1024,
                      startup_timeout_s=420) as srv:
        prompt = list(range(100, 420))
        first = srv.generate(input_ids=prompt, max_new_tokens=6, ignore_eos=True)["output_ids"]
        flush(srv.base_url)
        again = srv.generate(input_ids=prompt, max_new_tokens=6, ignore_eos=True)["output_ids"]
        other = srv.generate(input_ids=list(range(900, 1200)), max_new_tokens=6, ignore_eos=True)["output_ids"]
        assert first == again and len(other) == 6
        assert not srv.grep_log(r"Traceback|NameError")
