"""End to end: a real sglang.launch_server on the CPU platform with small prefill chunks, stock
cache vs `--radix-cache-backend kllm_incremental`: identical greedy outputs, and the plugin's
tail-insert counters move (with no stale-state fallback)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kllm_plugins.testing.sglang_server import SGLangServer

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


def _run(model: Path, plugin: bool) -> tuple[list[list[int]], dict[str, object]]:
    args = ["--chunked-prefill-size", str(CHUNK), "--dtype", "float32"]
    env = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    plugins: list[str] = []
    if plugin:
        args += ["--radix-cache-backend", "kllm_incremental"]
        env.update({"KLLM_EXTRA_PLUGINS": HOOKIMPLS, "KLLM_INCR_PREFIX_PUBLISH_INTERVAL_S": "0.1"})
        plugins = ["incr_prefix"]
    with SGLangServer(model, plugins=plugins, extra_args=args, env=env, max_total_tokens=4096) as srv:
        outs = []
        for ids in _prompts():
            res = srv.generate(input_ids=ids, max_new_tokens=6, ignore_eos=True)
            outs.append(list(res["output_ids"]))
        stats: dict[str, object] = {}
        if plugin:
            time.sleep(0.3)
            stats = srv.get_json("/kllm/stats").get("incr_prefix", {})
            assert srv.grep_log(r"kllm-plugins .* active \(role=subprocess") != []
        return outs, stats


def test_outputs_identical_and_tail_inserts_counted(tiny_model_path: Path) -> None:
    stock, _ = _run(tiny_model_path, plugin=False)
    ours, stats = _run(tiny_model_path, plugin=True)
    assert ours == stock
    total = stats["total"]
    assert isinstance(total, dict)
    # 700-token prompts in 64-token chunks: each long prompt checkpoints 10 times after its first
    assert total["tail_inserts"] >= 15, total
    assert total["skipped_tokens"] > 0, total
    assert total["fallbacks"] == 0, total
