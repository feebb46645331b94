"""Layer: service (no SGLang import). Talking to one instance: probing and the per-attempt book-keeping."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kllm_plugins.plugins.bigpd_router.core.input_limits import ModelLimits, vocab_from_config
from kllm_plugins.plugins.bigpd_router.core.registry import Instance, Role
from kllm_plugins.plugins.bigpd_router.core.slo_load import decode_batch, observe_tpot

PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BeforeFirstToken(Exception):
    """An attempt failed before anything reached the client: it may be retried elsewhere."""

    def __init__(self, urls: set[str], reason: str, status: int = 502, crashed: bool = False) -> None:
        super().__init__(reason)
        self.urls = urls
        self.reason = reason
        self.status = status
        self.crashed = crashed
        """The instance took the request and dropped the connection with no answer (it may have died of it)."""


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Role, capacity and bootstrap port as the instance itself reports them (SGLang /server_info)."""
    t = aiohttp.ClientTimeout(total=timeout_s)
    for path in ("/server_info", "/get_server_info"):
        try:
            async with session.get(url + path, timeout=t) as r:
                if r.status == 200:
                    info = await r.json(content_type=None)
                    break
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
            continue
    else:
        raise ConnectionError(f"{url} does not answer /server_info")
    mode = info.get("disaggregation_mode") or "null"
    role = {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(mode, Role.PLAIN)
    return {
        # SGLang 0.5.23 reports the role the server was launched with: after a /pd_role_switch
        # /server_info still says the old one, so the router keeps the role it switched to
        "role": role,
        "role_switch": bool(info.get("enable_pd_role_switch")),
        "capacity_tokens": int(info.get("max_total_num_tokens") or 0),
        # reported whatever the role: a decode instance started with --enable-pd-role-switch has a
        # bootstrap server too, and needs it once it is switched to prefill
        "bootstrap_port": info.get("disaggregation_bootstrap_port"),
        "transfer_backend": info.get("disaggregation_transfer_backend"),
        "kv_events": info.get("kv_events") if isinstance(info.get("kv_events"), dict) else None,
        "tokenizer_path": info.get("tokenizer_path") if isinstance(info.get("tokenizer_path"), str) else None,
    }


def parse_loads(payload: dict[str, Any]) -> dict[str, float]:
    """Sum SGLang /v1/loads over DP ranks into the fields the router uses."""
    out = {"running": 0.0, "waiting": 0.0, "waiting_tokens": 0.0, "used": 0.0, "total": 0.0, "gen": 0.0}
    for load in payload.get("loads", []):
        out["running"] += load.get("num_running_reqs", 0)
        out["waiting"] += load.get("num_waiting_reqs", 0)
        out["waiting_tokens"] += load.get("num_waiting_uncached_tokens", 0)
        out["used"] += load.get("num_used_tokens", 0)
        out["total"] += load.get("max_total_num_tokens", 0)
        out["gen"] += load.get("gen_throughput", 0.0)
    return out


@dataclass(slots=True)
class Ticket:
    """Book-keeping of one request on one instance; every step is idempotent."""

    inst: Instance
    prompt_tokens: int
    backlog_at_dispatch: int
    t0: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None
    events: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.inst.in_flight += 1
        self.inst.pending_prefill_tokens += self.prompt_tokens

    def first_token(self, at: float | None = None, learn: bool = True) -> float:
        """Mark the first token (now, or at `at` when it is only inferred); returns the TTFT. The
        instance's prefill rate learns from it unless `learn` is False (a guess not worth learning)."""
        if self.t_first is None:
            self.t_first = time.monotonic() if at is None else max(self.t0, at)
            self.inst.pending_prefill_tokens -= self.prompt_tokens
            self.inst.decoding += 1
            ttft = self.t_first - self.t0
            if ttft > 0 and learn:
                self.inst.prefill_rate.update((self.backlog_at_dispatch + self.prompt_tokens) / ttft)
        return self.t_first - self.t0

    def prefill_done(self) -> None:
        """For a PD prefill instance: its part ends with the prefill (no decode here)."""
        if self.t_first is None:
            self.first_token()
        self.finish()

    def tpot(self) -> float | None:
        if self.t_first is None or self.t_last is None or self.events < 2:
            return None
        return (self.t_last - self.t_first) / (self.events - 1)

    def finish(self, tokens: int | None = None) -> None:
        if self.done:
            return
        self.done = True
        if self.t_first is None:
            self.inst.pending_prefill_tokens -= self.prompt_tokens
        else:
            tp = self.tpot()
            if tp is None and tokens and tokens > 1 and self.t_last is not None:
                tp = (self.t_last - self.t_first) / (tokens - 1)
            if tp is not None and tp > 0:
                observe_tpot(self.inst, tp, decode_batch(self.inst))
            self.inst.decoding -= 1
        self.inst.in_flight -= 1


async def fetch_limits(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> ModelLimits:
    """Vocabulary size and context length of the model an instance serves, as far as it tells:
    /v1/models gives max_model_len, /model_info the model folder whose config.json has vocab_size."""
    t = aiohttp.ClientTimeout(total=timeout_s)
    vocab = ctx = None
    try:
        async with session.get(url + "/v1/models", timeout=t) as r:
            if r.status == 200:
                data = (await r.json(content_type=None)).get("data") or [{}]
                v = data[0].get("max_model_len")
                ctx = v if isinstance(v, int) and v > 0 else None
        async with session.get(url + "/model_info", timeout=t) as r:
            if r.status == 200:
                info = await r.json(content_type=None)
                v = info.get("vocab_size")
                vocab = v if isinstance(v, int) and v > 0 else None
                for key in ("model_path", "tokenizer_path"):
                    vocab = vocab or vocab_from_config(info.get(key) if isinstance(info.get(key), str) else None)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, AttributeError, IndexError):
        pass
    return ModelLimits(vocab, ctx)
