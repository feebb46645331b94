"""Layer: service test double (no SGLang import). A stand-in for an SGLang server.

Answers the endpoints the router uses (/health, /server_info, /v1/loads, /generate,
/v1/completions, /v1/chat/completions, streaming or not) with a configurable time to first
token and time per output token, and keeps a toy prefix cache so `cached_tokens` behaves like
SGLang's (one token per 4 prompt characters). Used by the unit tests, the reliability tests and
the router-overhead benchmark; `--fail-after-events N` makes it drop streams mid-way.
It reports no model path on purpose: other routers would try to fetch a tokenizer for it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeBackend:
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    role: str = "null"
    bootstrap_port: int = 8998
    capacity_tokens: int = 4096
    fail_after_events: int = -1
    """Drop the connection after this many stream events (-1: never)."""
    stall_after_events: int = -1
    """Go silent (hold the connection, send nothing) after this many stream events (-1: never)."""
    status_override: int = 0
    """Answer every generation request with this HTTP status (0: normal)."""
    healthy: bool = True
    running: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    record: bool = True
    kv_events: dict[str, Any] | None = None
    """What /server_info reports under `kv_events` (a publisher descriptor), if anything."""
    pd_role_switch: bool = False
    """Started with --enable-pd-role-switch: /server_info says so and, like SGLang 0.5.23, keeps
    reporting the launch role after a switch."""
    skip_tokenizer_init: bool = False
    """Started with --skip-tokenizer-init: like SGLang, a /generate with text is answered 400."""
    crash_on: str = ""
    """A request whose body contains this text 'kills' the server: that connection and every later
    one are dropped with no answer (a stand-in for SGLang's scheduler dying of a bad token id)."""
    model_path: str = ""
    """What /model_info reports as model_path (a folder with a config.json gives the vocabulary)."""
    context_len: int = 0
    """max_model_len in /v1/models (0: not reported)."""
    stamp: bool = False
    """Each stream event carries `sent_ns`, time.monotonic_ns() as it is written (CLOCK_MONOTONIC is
    one clock for every process of a machine): a client beside it times each token's delivery."""
    dead: bool = False
    flushes: int = 0
    _cache: set[str] = field(default_factory=set)
    _launch_role: str = ""

    def __post_init__(self) -> None:
        self._launch_role = self.role

    def cached_chars(self, prompt: str) -> int:
        n = 0
        for end in range(16, len(prompt) + 1, 16):
            if prompt[:end] not in self._cache:
                break
            n = end
        for end in range(16, len(prompt) + 1, 16):
            self._cache.add(prompt[:end])
        return n

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._dead_drop])
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/pd_role_switch", self.role_switch)
        app.router.add_post("/generate", self.gen)
        app.router.add_post("/v1/completions", self.gen)
        app.router.add_post("/v1/chat/completions", self.gen)
        return app

    @web.middleware
    async def _dead_drop(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.dead:
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("fake backend is dead")
        return await handler(request)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.flushes += 1
        return web.Response(text="Cache flushed.\n")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        info = {"disaggregation_mode": self._launch_role if self.pd_role_switch else self.role,
                "enable_pd_role_switch": self.pd_role_switch, "max_total_num_tokens": self.capacity_tokens,
                "disaggregation_bootstrap_port": self.bootstrap_port,
                "disaggregation_transfer_backend": "fake", "version": "fake"}
        if self.kv_events is not None:
            info["kv_events"] = self.kv_events
        return web.json_response(info)

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.running, "num_waiting_reqs": 0,
                                             "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                                             "max_total_num_tokens": self.capacity_tokens,
                                             "gen_throughput": 0.0}]})

    async def role_switch(self, request: web.Request) -> web.Response:
        """Like SGLang's: flips prefill<->decode, refused while requests run or for a plain server."""
        body = await request.json()
        new = body.get("new_role")
        if self.role not in ("prefill", "decode") or new not in ("prefill", "decode"):
            return web.json_response({"success": False, "message": "refused"}, status=400)
        if self.running:
            return web.json_response({"success": False, "message": "instance is not idle; drain all requests "
                                      "before switching", "safe_to_restore": True}, status=400)
        if new == "decode" and new != self.role and body.get("decode_cuda_graph_memory_gb") is None:
            return web.json_response({"success": False, "message": "decode_cuda_graph_memory_gb is required "
                                      "before capturing decode graphs"}, status=400)
        old, self.role = self.role, new
        return web.json_response({"success": True, "old_role": old, "new_role": new})

    async def models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {"id": "fake", "object": "model"}
        if self.context_len:
            model["max_model_len"] = self.context_len
        return web.json_response({"object": "list", "data": [model]})

    async def gen(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        if self.crash_on and self.crash_on.encode() in raw:
            self.dead = True
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("fake backend died of a poison request")
        if self.record:
            self.requests.append({"path": request.path, "body": body, "rid": request.headers.get("X-Request-Id")})
        if self.status_override:
            return web.json_response({"error": "injected"}, status=self.status_override)
        if request.path == "/generate" and self.skip_tokenizer_init and body.get("text") is not None:
            return web.json_response({"error": {"message": "The engine initialized with skip_tokenizer_init=True "
                                                "cannot accept text prompts."}}, status=400)
        if request.path == "/generate":
            prompt = body.get("text") or " ".join(map(str, body.get("input_ids", [])))
            n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))
        elif request.path == "/v1/completions":
            prompt, n = str(body.get("prompt")), int(body.get("max_tokens") or 4)
        else:
            prompt = json.dumps(body.get("messages"))
            n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        meta = {"id": uuid.uuid4().hex, "prompt_tokens": max(1, len(prompt) // 4), "completion_tokens": n,
                "cached_tokens": self.cached_chars(prompt) // 4}
        self.running += 1
        try:
            if self.ttft_s and not await _sleep_unless_gone(request, self.ttft_s):
                return web.Response(status=499)
            if not body.get("stream"):
                if self.tpot_s and n > 1 and not await _sleep_unless_gone(request, self.tpot_s * (n - 1)):
                    return web.Response(status=499)  # like SGLang: the client left, the request is aborted
                return web.json_response(self._final(request.path, n, meta))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                if i and self.tpot_s and not await _sleep_unless_gone(request, self.tpot_s):
                    return resp
                if i == self.stall_after_events:
                    await _sleep_unless_gone(request, 3600)
                    return resp
                if i == self.fail_after_events:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                event = self._chunk(request.path, i, n, meta)
                if self.stamp:
                    event["sent_ns"] = time.monotonic_ns()
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1

    @staticmethod
    def _final(path: str, n: int, meta: dict[str, Any]) -> dict[str, Any]:
        text = " tok" * n
        usage = {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": n,
                 "total_tokens": meta["prompt_tokens"] + n}
        if path == "/generate":
            return {"text": text, "output_ids": list(range(n)), "meta_info": meta}
        if path == "/v1/completions":
            return {"id": meta["id"], "object": "text_completion", "created": int(time.time()), "model": "fake",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage}
        return {"id": meta["id"], "object": "chat.completion", "created": int(time.time()), "model": "fake",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length"}], "usage": usage}

    @staticmethod
    def _chunk(path: str, i: int, n: int, meta: dict[str, Any]) -> dict[str, Any]:
        if path == "/generate":
            # like SGLang: cumulative text, completion_tokens so far (bench_serving derives ITL from it)
            return {"text": " tok" * (i + 1), "output_ids": list(range(i + 1)),
                    "meta_info": dict(meta, completion_tokens=i + 1)}
        if path == "/v1/completions":
            return {"id": meta["id"], "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}]}
        return {"id": meta["id"], "object": "chat.completion.chunk", "model": "fake",
                "choices": [{"index": 0, "delta": {"content": " tok"},
                             "finish_reason": "length" if i == n - 1 else None}]}


async def _sleep_unless_gone(request: web.Request, seconds: float) -> bool:
    """Sleep, waking early (False) when the client's connection closes: aiohttp does not cancel
    the handler then, SGLang aborts the request."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        if request.transport is None or request.transport.is_closing():
            return False
        await asyncio.sleep(min(left, 0.05))
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fake SGLang server for router tests and benchmarks")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-s", type=float, default=0.0)
    ap.add_argument("--tpot-s", type=float, default=0.0)
    ap.add_argument("--disaggregation-mode", default="null")
    ap.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    ap.add_argument("--crash-on", default="", help="a request whose body contains this text kills the server")
    ap.add_argument("--model-info-path", default="", help="model_path reported by /model_info")
    ap.add_argument("--context-len", type=int, default=0, help="max_model_len reported by /v1/models")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="refuse text prompts, as SGLang does")
    ap.add_argument("--stamp", action="store_true", help="stream events carry sent_ns (time.monotonic_ns())")
    args, _ = ap.parse_known_args(argv)  # SGLang flags from an actuator are accepted and ignored
    fb = FakeBackend(ttft_s=args.ttft_s, tpot_s=args.tpot_s, role=args.disaggregation_mode,
                     bootstrap_port=args.disaggregation_bootstrap_port, record=False, crash_on=args.crash_on,
                     model_path=args.model_info_path, context_len=args.context_len,
                     skip_tokenizer_init=args.skip_tokenizer_init, stamp=args.stamp)
    web.run_app(fb.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
