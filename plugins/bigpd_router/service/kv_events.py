"""Layer: service (no SGLang import). Subscribing to the KV events SGLang instances publish.

An instance started with `--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'`
(or kv_tiers' `kllm_tiers` publisher) describes its publisher under `kv_events` in `/server_info`:
host (a wildcard means "the instance's own host"), base port (one PUB socket per DP rank),
topic and block size. For each such instance one ZMQ SUB socket per rank is read by one task;
every message is `(topic, seq, msgpack EventBatch [ts, [events], dp_rank])` and its events go
into the core `KvIndex`.

To look a prompt up, the router needs its token ids: `input_ids` requests carry them; for text
and chat it tokenizes with the instances' tokenizer (`tokenizer_path` option, else the path the
instance reports, if it exists here). Without a tokenizer, text prompts fall back to the
approximate prefix tree.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Sequence
from urllib.parse import urlsplit

from kllm_plugins.plugins.bigpd_router.core.kv_index import KvIndex
from kllm_plugins.plugins.bigpd_router.core.registry import Instance
from kllm_plugins.plugins.bigpd_router.core.request_shape import RequestShape

log = logging.getLogger("kllm.bigpd_router.kv_events")
WILDCARDS = ("*", "0.0.0.0", "::", "")


def sub_endpoints(inst_url: str, desc: dict[str, Any]) -> list[str]:
    """The SUB endpoints of an instance's publisher, one per DP rank."""
    host = desc.get("endpoint_host") or "*"
    if host in WILDCARDS:
        host = urlsplit(inst_url).hostname or "127.0.0.1"
    base = int(desc["endpoint_port_base"])
    return [f"tcp://{host}:{base + rank}" for rank in range(int(desc.get("dp_size") or 1))]


class KvEventFeed:
    def __init__(self, index: KvIndex, enabled: bool = True, tokenizer_path: str = "") -> None:
        self.index = index
        self.enabled = enabled
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._tokenizer_tried = False
        self.tokenizer_loading: asyncio.Future[None] | None = None
        """Set while (and after) the tokenizer loads in a worker thread; awaitable."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: Any = None

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, inst: Instance) -> None:
        if not self.enabled or not inst.kv_events or inst.url in self._tasks:
            return
        try:
            import zmq.asyncio
        except ImportError:
            log.warning("pyzmq is not installed: KV events of %s ignored", inst.url)
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        endpoints = sub_endpoints(inst.url, inst.kv_events)
        self._tasks[inst.url] = asyncio.get_running_loop().create_task(
            self._read(inst.url, endpoints, str(inst.kv_events.get("topic") or ""),
                       int(inst.kv_events.get("block_size") or 0)))
        if not self.tokenizer_path and inst.tokenizer_path and os.path.exists(inst.tokenizer_path):
            self.tokenizer_path = inst.tokenizer_path
        if self.tokenizer_path and not self._tokenizer_tried:
            self._tokenizer_tried = True
            self.tokenizer_loading = asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        log.info("subscribed to KV events url=%s endpoints=%s", inst.url, endpoints)

    def unsubscribe(self, url: str) -> None:
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self.index.forget(url)

    async def _read(self, url: str, endpoints: list[str], topic: str, block_size: int) -> None:
        import msgspec
        import zmq

        decoder = msgspec.msgpack.Decoder()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        for ep in endpoints:
            sock.connect(ep)
        last_seq: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if last_seq is not None and len(endpoints) == 1 and seq != last_seq + 1:
                    log.warning("KV events of %s skipped %d batches", url, seq - last_seq - 1)
                last_seq = seq
                try:
                    batch = decoder.decode(frames[2])
                    events = batch[1] if isinstance(batch, (list, tuple)) else batch.get("events", [])
                except (msgspec.DecodeError, IndexError, AttributeError):
                    log.warning("undecodable KV event batch from %s", url)
                    continue
                self.index.apply(url, [e for e in events if isinstance(e, dict)], block_size)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV event subscription of %s failed", url)
        finally:
            sock.close(0)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ prompts as token ids
    def _load_tokenizer(self) -> None:
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            log.info("tokenizer for KV-event lookups: %s", self.tokenizer_path)
        except Exception as exc:  # noqa: BLE001 - any failure means "no tokenizer": fall back to the tree
            log.warning("cannot load tokenizer %s (%s): text prompts use the prefix tree", self.tokenizer_path, exc)

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def token_ids(self, shape: RequestShape) -> Sequence[int] | None:
        """The prompt as the instances will tokenize it, or None when that is not known here."""
        if not isinstance(shape.prompt, str):
            return shape.prompt
        tok = self._tokenizer
        if tok is None:
            return None
        try:
            if shape.endpoint == "chat":
                return list(tok.apply_chat_template(shape.body["messages"], tokenize=True,
                                                    add_generation_prompt=True))
            return list(tok.encode(shape.prompt))
        except Exception:  # noqa: BLE001 - a template that fails here fails in SGLang too; do not route on it
            return None
