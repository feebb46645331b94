"""Layer: core (no SGLang import). What the router needs to know about one request body.

Validates the parts the router relies on (so malformed input gets a clear 4xx here, not an
opaque error from an instance) and extracts the prompt used for cache affinity, the expected
output length and whether the answer streams. Everything else passes through untouched.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kllm_plugins.plugins.bigpd_router.core.prefix_tree import Prompt

try:  # a fifth of json's cost on the small bodies the router sees
    import orjson

    def loads(raw: bytes) -> Any:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:  # what orjson refuses but json reads (integers over 64 bits, NaN)
            return json.loads(raw)
except ImportError:  # pragma: no cover - orjson ships with SGLang
    loads = json.loads


class BadRequest(ValueError):
    """The body is malformed; the message is returned to the client with HTTP 400."""


@dataclass(frozen=True)
class RequestShape:
    endpoint: str
    body: dict[str, Any]
    prompt: Prompt
    prompt_chars: int
    stream: bool
    max_new_tokens: int | None


def _text_of_messages(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(f"{m['role']}:{content}")
        elif isinstance(content, list):  # only string texts count for affinity; the instance judges the rest
            parts.append(f"{m['role']}:" + "".join(
                c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)))
        elif content is None:
            parts.append(f"{m['role']}:")
        else:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
    return "\n".join(parts)


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"'{key}' must be a non-negative integer, got {v!r}")
    return v


def _all_ints(xs: list[Any]) -> bool:
    """Every item an int (bools too, as isinstance says), looped in C: a prompt of token ids is
    checked once per request, thousands of ids long."""
    return all(map(isinstance, xs, repeat(int)))


def parse(endpoint: str, raw: bytes) -> RequestShape:
    """endpoint is one of "generate", "completions", "chat"."""
    try:
        body = loads(raw)
    except ValueError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}")
    prompt: Prompt
    if endpoint == "chat":
        prompt = _text_of_messages(body.get("messages"))
        max_new = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    elif endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = p
        elif isinstance(p, list) and p and _all_ints(p):
            prompt = p
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            prompt = p[0]
        else:
            raise BadRequest("'prompt' must be a string, a list of token ids or a one-element list of strings")
        max_new = _positive_int(body, "max_tokens")
    elif endpoint == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, str):
            prompt = text
        elif isinstance(ids, list) and ids and _all_ints(ids):
            prompt = ids
        elif isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
            raise BadRequest("batched 'text'/'input_ids' are not supported by the router; send one request each")
        else:
            raise BadRequest("one of 'text' (string) or 'input_ids' (list of ints) is required")
        sp = body.get("sampling_params", {})
        if not isinstance(sp, dict):
            raise BadRequest("'sampling_params' must be an object")
        max_new = _positive_int(sp, "max_new_tokens")
    else:
        raise BadRequest(f"unknown endpoint {endpoint!r}")
    chars = len(prompt) if isinstance(prompt, str) else 4 * len(prompt)
    return RequestShape(endpoint, body, prompt, chars, stream, max_new)
