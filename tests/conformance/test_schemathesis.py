"""schemathesis against SGLang's own OpenAPI schema (`/openapi.json`), loopback only, bounded.

1. The server with every plugin: cases generated from its schema, valid and malformed
   (schemathesis' positive and negative modes, derandomized so CI replays the same inputs), on
   the serving and read-only operations (`FUZZED`; operations that change weights, memory, LoRA,
   profiling or pause the server are left out). Every answer comes within `TIMEOUT_S` and none is
   a 5xx.
2. kllm-router in front of a stock server, fed cases from the stock server's schema for the
   operations it routes: no 5xx, no hang, and the same status class as the stock server's own
   answer to the same request.

Requested lengths are clamped (`LIMITS`) so a valid case does not decode thousands of tokens on a
CPU; malformed values (negative, wrong types) are left as generated.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import requests

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

TIMEOUT_S = 90
EXAMPLES = 5  # per operation and mode (generating malformed cases of the big OpenAI schemas is slow)
FUZZED = {
    ("GET", "/health"), ("GET", "/ping"), ("GET", "/get_model_info"), ("GET", "/model_info"),
    ("GET", "/get_server_info"), ("GET", "/server_info"), ("GET", "/v1/models"), ("GET", "/v1/models/{model}"),
    ("GET", "/v1/loads"), ("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/tokenize"), ("POST", "/v1/detokenize"),
}
ROUTED = {
    ("GET", "/health"), ("GET", "/get_model_info"), ("GET", "/model_info"), ("GET", "/get_server_info"),
    ("GET", "/server_info"), ("GET", "/v1/models"), ("POST", "/generate"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
}
LIMITS = {"max_tokens": 8, "max_completion_tokens": 8, "max_new_tokens": 8, "n": 2, "best_of": 2,
          "logprobs": 3, "top_logprobs": 3, "top_logprobs_num": 3}


def clamp(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in LIMITS and isinstance(v, int) and not isinstance(v, bool) and v > LIMITS[k]:
                v = LIMITS[k]
            out[k] = clamp(v)
        return out
    if isinstance(obj, list):
        return [clamp(v) for v in obj]
    return obj


def _operations(schema_dict: dict[str, Any], wanted: set[tuple[str, str]]) -> list[Any]:
    schema = schemathesis.openapi.from_dict(schema_dict)
    ops = [r.ok() for r in schema.get_all_operations()]
    picked = [op for op in ops if (op.method.upper(), op.path) in wanted]
    assert {(op.method.upper(), op.path) for op in picked} == wanted, "schema lacks an operation"
    return picked


def _send(case: Any, base_url: str) -> tuple[int, str]:
    kwargs = case.as_transport_kwargs(base_url=base_url)
    if "json" in kwargs:
        kwargs["json"] = clamp(kwargs["json"])
    kwargs.pop("timeout", None)
    resp = requests.request(**kwargs, timeout=TIMEOUT_S)
    return resp.status_code, resp.text[:200]


def _run(op: Any, mode: Any, check: Any) -> list[str]:
    problems: list[str] = []

    @settings(max_examples=EXAMPLES, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        try:
            problem = check(case)
        except requests.RequestException as exc:  # a hang (timeout) or a dropped connection
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            body = case.body if not isinstance(case.body, dict) else clamp(case.body)
            problems.append(f"{op.method.upper()} {case.formatted_path} {json.dumps(body, default=str)[:200]}: {problem}")

    try:
        one()
    except Unsatisfiable:  # nothing malformed to generate (e.g. a plain string path parameter)
        assert mode == GenerationMode.NEGATIVE, op.path
    return problems


@pytest.fixture(scope="module")
def schema_of(server_pool: Any, no_proxy_env: None) -> Any:
    def get(profile: str) -> dict[str, Any]:
        url = server_pool.get(profile).server.base_url
        return requests.get(url + "/openapi.json", timeout=60).json()
    return get


# found by the full run (benchmarks/results/conformance/full_run.json), not yet fixed or traced to
# stock SGLang: valid cases get HTTP 500 from GET /v1/loads and from /v1/detokenize on token ids
# out of int range, and one generated chat request outlived TIMEOUT_S on a loaded machine
SERVER_FOUND = ("SGLang answers valid generated cases with HTTP 500 (GET /v1/loads; /v1/detokenize on "
                "out-of-range token ids) and one chat case passed the 90 s timeout under load")
# kllm-router answers some generated chat bodies with 500 'internal router error' where SGLang answers 400
ROUTER_FOUND = "kllm-router: HTTP 500 'internal router error' on generated chat bodies that SGLang answers with 400"
VALID_XFAIL = pytest.mark.xfail(reason=SERVER_FOUND, strict=False)


@pytest.mark.parametrize("mode", [pytest.param(GenerationMode.POSITIVE, marks=VALID_XFAIL), GenerationMode.NEGATIVE],
                         ids=["valid", "malformed"])
def test_every_plugin_server_no_5xx_no_hang(mode: Any, server_pool: Any, schema_of: Any) -> None:
    schema = schema_of("all")
    run = server_pool.get("all")
    problems: list[str] = []
    for op in _operations(schema, FUZZED):
        def check(case: Any) -> str:
            status, text = _send(case, run.server.base_url)
            return f"HTTP {status} {text}" if status >= 500 else ""
        problems += _run(op, mode, check)
        assert run.server.proc is not None and run.server.proc.poll() is None, f"server died: {problems[-3:]}"
    assert not problems, "\n".join(problems[:20])


@pytest.mark.xfail(reason=ROUTER_FOUND, strict=False)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "malformed"])
def test_router_answers_like_sglang(mode: Any, server_pool: Any, schema_of: Any) -> None:
    schema = schema_of("stock")
    run = server_pool.behind_router("stock")
    assert run.router is not None
    problems: list[str] = []
    for op in _operations(schema, ROUTED):
        def check(case: Any) -> str:
            direct, dtext = _send(case, run.server.base_url)
            routed, rtext = _send(case, run.router.base_url)
            if routed >= 500:
                return f"router HTTP {routed} {rtext} (SGLang: {direct})"
            if routed // 100 != direct // 100:
                return f"router HTTP {routed} {rtext} but SGLang HTTP {direct} {dtext}"
            return ""
        problems += _run(op, mode, check)
    assert not problems, "\n".join(problems[:20])
