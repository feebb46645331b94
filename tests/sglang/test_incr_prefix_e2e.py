"""End to end: a real sglang.launch_server on the CPU platform with small prefill chunks and
`--radix-cache-backend kllm_incremental`: greedy outputs identical to the reference, cache hits on
the tree the tail inserts built, and the plugin's counters moving (with no stale-state fallback).
Two servers: the Python TreeCore (tail walk), and SGLang's default Rust TreeCore with HiCache's
L2 host tier on (the Rust path), page size 16."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kllm_plugins.testing.sglang_server import SGLangServer
from kllm_plugins.testing.hf_reference import hf_greedy

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

CHUNK = 64
HOOKIMPLS = "kllm_plugins.plugins.incr_prefix.hookimpls"


def _prompts() -> list[list[int]]:
    base = [(i * 37) % 3000 + 10 for i in range(700)]
    return [
        base,  # 11 chunks
        base[:400] + [(i * 11) % 3000 + 10 for i in range(300)],  # shares 400 tokens with the first
        base,  # a full hit on the finished first request, then decode
        [(i * 13) % 3000 + 10 for i in range(90)],  # short: two chunks
    ]


HICACHE_ARGS = [
    "--page-size", "16", "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "layer_first", "--hicache-write-policy", "write_through",
]


@pytest.mark.parametrize("treecore", ["python", "rust-hicache"])
def test_outputs_identical_and_tail_inserts_counted(tiny_model_path: Path, treecore: str) -> None:
    """One server with the plugin; the reference is transformers' greedy output in float32,
    which the stock server reproduces token for token (tests/sglang/test_host_e2e.py)."""
    args = ["--chunked-prefill-size", str(CHUNK), "--dtype", "float32", "--radix-cache-backend", "kllm_incremental"]
    env = {"KLLM_EXTRA_PLUGINS": HOOKIMPLS, "KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1"}
    plugins = ["incr_prefix"]
    if treecore == "python":
        env["KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE"] = "1"
    else:
        # HiCache runs on the CPU platform through the platform's own patch list
        # (hardware/cpu/patches.py): no kv_tiers plugin needed.
        args += HICACHE_ARGS
    prompts = _prompts()
    with SGLangServer(tiny_model_path, plugins=plugins, extra_args=args, env=env, max_total_tokens=4096,
                      startup_timeout_s=300) as srv:
        res = [srv.generate(input_ids=ids, max_new_tokens=6, ignore_eos=True) for ids in prompts]
        time.sleep(0.3)
        stats = srv.get_json("/kllm/stats").get("incr_prefix", {})
        assert srv.grep_log(r"incr_prefix: tail-only inserts off") == []
    assert [r["output_ids"] for r in res] == hf_greedy(tiny_model_path, prompts, 6)
    assert res[2]["meta_info"]["cached_tokens"] >= 640  # the tree the tail inserts built is matched
    total = stats["total"]
    # 700-token prompts in 64-token chunks: each long prompt checkpoints 10 times after its first
    # (page 16: 700 tokens give 43 full pages, so each long prompt still checkpoints 10 times)
    assert total["tail_inserts"] >= 15, total
    assert total["skipped_tokens"] > 0, total
    assert total["fallbacks"] == 0, total
