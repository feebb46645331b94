"""End to end: a real sglang.launch_server on the CPU platform with the trace plugin."""
from __future__ import annotations

import json
import math
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from kllm_plugins.testing.hf_reference import hf_greedy
from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

CHUNK = 64


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[SGLangServer]:
    # float32 on both sides: with random weights, bf16 rounding differs between engines enough
    # to flip near-tied argmaxes, which would test rounding rather than correctness.
    args = ["--chunked-prefill-size", str(CHUNK), "--dtype", "float32", "--enable-metrics"]
    with SGLangServer(tiny_model_path, plugins=["trace"], extra_args=args) as srv:
        yield srv


def trace_totals(server: SGLangServer) -> dict[str, int]:
    time.sleep(0.6)  # > publish interval: the idle pass has flushed
    return server.get_json("/kllm/stats")["trace"]["total"]


def test_every_process_attached_the_plugin(server: SGLangServer) -> None:
    info = server.get_json("/kllm/plugins")
    assert info["enabled"] == ["trace"]
    assert info["hooks"] and all(h["ok"] for h in info["hooks"])
    lines = server.grep_log(r"kllm-plugins .* active \(role=subprocess")
    # the host's own hooks, the CPU platform's list and the trace plugin's, all verified
    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.platform_patches import platform_patches
    from kllm_plugins.sglang_bridge import HOST_PATCHES

    n = len(HOST_PATCHES) + len(platform_patches("kllm_cpu")) + len(KllmPluginManager().specs["trace"].patches)
    assert len(lines) >= 2 and all("plugins=[trace]" in l and f"hooks applied {n}/{n}" in l for l in lines)


def test_greedy_output_equals_transformers(server: SGLangServer, tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = ["def parse_args(argv):", "The quick brown fox", "class A(object):", "import json\nimport csv\n" * 20]
    prompts = [tok(t)["input_ids"] for t in texts]
    assert len(prompts[-1]) > CHUNK  # the last one is prefilled in several chunks
    expected = hf_greedy(tiny_model_path, prompts, 16)
    got = [server.generate(input_ids=ids, max_new_tokens=16, ignore_eos=True)["output_ids"] for ids in prompts]
    assert got == expected


def test_chunked_prefill_moves_trace_counters(server: SGLangServer) -> None:
    before = trace_totals(server)
    prompt = list(range(10, 10 + 300))  # 300 fresh tokens, no cache hit
    out = server.generate(input_ids=prompt, max_new_tokens=5, ignore_eos=True)
    assert len(out["output_ids"]) == 5
    after = trace_totals(server)
    assert after["prefill_chunks"] - before["prefill_chunks"] == math.ceil(300 / CHUNK)
    assert after["decode_steps"] - before["decode_steps"] >= 4
    assert after["passes"] > before["passes"]


def test_chat_completions_and_streaming(server: SGLangServer) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    reply = server.post_json("/v1/chat/completions", body)
    content = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1

    req = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces: list[str] = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                delta = json.loads(line[5:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert len([p for p in pieces if p]) >= 2  # really streamed, several chunks
    assert "".join(pieces) == content


def test_generate_streaming(server: SGLangServer) -> None:
    req = urllib.request.Request(
        f"{server.base_url}/generate",
        data=json.dumps({"text": "class Parser:", "stream": True,
                         "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    assert len(events) >= 2
    whole = server.generate(text="class Parser:", max_new_tokens=6, ignore_eos=True)
    assert events[-1]["text"] == whole["text"]


def test_prometheus_metrics_from_scheduler_process(server: SGLangServer) -> None:
    server.generate(text="count me", max_new_tokens=3)
    time.sleep(0.5)
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("kllm_trace_decode_steps_total")]
    assert values and sum(values) >= 2
    assert "kllm_trace_prefill_chunks_total" in text
