"""The official `openai` SDK against a server with every plugin, and through kllm-router in front
of it: chat and completions, streaming and not, `n`, `stop`, `max_tokens`, `logprobs`, concurrent
async streams, the models list. Each call's result must equal the same call on stock SGLang
(SmolLM2-135M, float32, greedy): the same text, finish reasons, token counts and tokens, and
log-probabilities within float noise.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]  # each waits on a shared server (35-110 s to start)

openai = pytest.importorskip("openai")

MODEL = "default"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The capital of France is"
STREAM_PROMPTS = [f"Write one sentence about the number {k}." for k in range(6)]


def _client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=300, max_retries=0)


def _choice_text(c: Any) -> str:
    return c.message.content if hasattr(c, "message") else c.text


def _chat(cl: Any) -> dict[str, Any]:
    r = cl.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    return {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
            "usage": (r.usage.prompt_tokens, r.usage.completion_tokens), "n": len(r.choices)}


def _chat_stream(cl: Any) -> dict[str, Any]:
    parts, finish = [], None
    for ev in cl.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True):
        for c in ev.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return {"text": "".join(parts), "finish": finish}


def _completion(cl: Any) -> dict[str, Any]:
    r = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
            "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)}


def _completion_stream(cl: Any) -> dict[str, Any]:
    parts, finish = [], None
    for ev in cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True):
        for c in ev.choices:
            parts.append(c.text or "")
            finish = c.finish_reason or finish
    return {"text": "".join(parts), "finish": finish}


def _n(cl: Any) -> dict[str, Any]:
    r = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    return {"texts": sorted(c.text for c in r.choices), "indices": sorted(c.index for c in r.choices)}


def _chat_n(cl: Any) -> dict[str, Any]:
    r = cl.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, n=2)
    return {"texts": sorted(c.message.content for c in r.choices), "indices": sorted(c.index for c in r.choices)}


def _stop(cl: Any) -> dict[str, Any]:
    r = cl.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=40, temperature=0,
                              stop=[","])
    c = r.choices[0]
    assert "," not in c.text
    return {"text": c.text, "finish": c.finish_reason}


def _chat_stop(cl: Any) -> dict[str, Any]:
    r = cl.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, stop=[","])
    c = r.choices[0]
    assert "," not in (c.message.content or "")
    return {"text": c.message.content, "finish": c.finish_reason}


def _max_tokens(cl: Any) -> dict[str, Any]:
    r = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    return {"text": r.choices[0].text, "usage": r.usage.completion_tokens}


def _logprobs(cl: Any) -> dict[str, Any]:
    r = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6
    return {"text": r.choices[0].text, "tokens": lp.tokens, "logprobs": lp.token_logprobs,
            "top": [sorted(d) for d in lp.top_logprobs]}


def _chat_logprobs(cl: Any) -> dict[str, Any]:
    r = cl.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    return {"text": r.choices[0].message.content, "tokens": [t.token for t in content],
            "logprobs": [t.logprob for t in content], "top": [sorted(x.token for x in t.top_logprobs) for t in content]}


def _async_streams(base_url: str) -> dict[str, Any]:
    async def one(cl: Any, prompt: str) -> str:
        parts = []
        stream = await cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=12, temperature=0, stream=True)
        async for ev in stream:
            for c in ev.choices:
                parts.append(c.delta.content or "")
        return "".join(parts)

    async def go() -> list[str]:
        cl = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=300, max_retries=0)
        try:
            return list(await asyncio.gather(*(one(cl, p) for p in STREAM_PROMPTS)))
        finally:
            await cl.close()

    texts = asyncio.run(go())
    assert all(texts), texts
    return {"texts": texts}


def _models(cl: Any) -> dict[str, Any]:
    ids = sorted(m.id for m in cl.models.list().data)
    assert ids
    return {"ids": ids}


CALLS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "chat": _chat, "chat_stream": _chat_stream, "completion": _completion,
    "completion_stream": _completion_stream, "n": _n, "chat_n": _chat_n, "stop": _stop, "chat_stop": _chat_stop,
    "max_tokens": _max_tokens, "logprobs": _logprobs, "chat_logprobs": _chat_logprobs, "models": _models,
}
URL_CALLS: dict[str, Callable[[str], dict[str, Any]]] = {"async_streams": _async_streams}


def _call(name: str, base_url: str) -> dict[str, Any]:
    if name in URL_CALLS:
        return URL_CALLS[name](base_url)
    return CALLS[name](_client(base_url))


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if key == "logprobs":
            assert len(got[key]) == len(want[key])
            assert all(abs(a - b) < 2e-3 for a, b in zip(got[key], want[key])), (got[key], want[key])
        else:
            assert got[key] == want[key], (key, got[key], want[key])


@pytest.fixture(scope="module")
def stock_results(server_pool: Any, no_proxy_env: None) -> dict[str, dict[str, Any]]:
    url = server_pool.get("stock").base_url
    return {name: _call(name, url) for name in [*CALLS, *URL_CALLS]}


@pytest.mark.parametrize("target", ["all", "router_all"])
@pytest.mark.parametrize("name", [*CALLS, *URL_CALLS])
def test_openai_sdk_equals_stock(name: str, target: str, server_pool: Any,
                                 stock_results: dict[str, dict[str, Any]]) -> None:
    run = server_pool.behind_router("all") if target == "router_all" else server_pool.get("all")
    got = _call(name, run.base_url)
    _same(got, stock_results[name])
    if name == "chat_stream":  # streamed and whole answers agree
        assert got["text"] == stock_results["chat"]["text"]
    if name == "completion_stream":
        assert got["text"] == stock_results["completion"]["text"]
