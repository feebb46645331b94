"""Benchmark helper (not library code): start a CPU SGLang server on a free port and drive it with the
harness's streaming client (`kllm_plugins.bench.client.astream`), recording TTFT, TPOT and latency per request.

Used by bench_fair_sched.py and by tests/sglang/test_fair_sched_e2e.py. Prompts are token ids
(`input_ids`), so their lengths are exact; outputs use `ignore_eos` so their lengths are too.
"""
from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from kllm_plugins.bench.client import astream
from targets import STOCK

EP_SHIM = "kllm_fair_sched_dev-0.0.dist-info"


def entry_point_shim() -> str | None:
    """A folder for PYTHONPATH declaring the fair_sched entry point, if the installed package
    does not declare it yet (until it is listed in pyproject.toml)."""
    from importlib.metadata import entry_points

    if any(ep.name == "fair_sched" for ep in entry_points(group="kllm_plugins")):
        return None
    root = os.path.join(tempfile.gettempdir(), "kllm_fair_sched_ep")
    info = os.path.join(root, EP_SHIM)
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as fh:
        fh.write("Metadata-Version: 2.1\nName: kllm-fair-sched-dev\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w", encoding="utf-8") as fh:
        fh.write("[kllm_plugins]\nfair_sched = kllm_plugins.plugins.fair_sched.hookimpls\n")
    return root


def sglang_server(model: str, plugins: Sequence[str] = (), extra_args: Sequence[str] = (),
                  max_total_tokens: int = 16384, env: dict[str, str] | None = None) -> Any:
    """The host's `SGLangServer` (CPU platform, strict), with the fair_sched entry point made
    visible to SGLang's processes when the installed package does not declare it yet."""
    from kllm_plugins.testing.sglang_server import SGLangServer

    full_env = dict(env or {})
    shim = entry_point_shim()
    if shim:
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH", "")) if p)
    return SGLangServer(model, plugins=plugins, extra_args=extra_args, env=full_env, max_total_tokens=max_total_tokens)


MIXED = "+mixed"
"""Suffix of a stock server run with SGLang's --enable-mixed-chunk (`shortest-prefill-first+mixed`)."""


def mixed_stock(policy: str) -> str | None:
    """The stock policy of a `POLICY+mixed` server (SGLang's mixed chunk on), else None."""
    base = policy.removesuffix(MIXED)
    return base if base != policy and base in STOCK else None


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`TAG:KEY=V[,KEY=V]` (a benchmark's `--variant`) -> ("fair_sched/TAG", environment); a KEY
    without the `KLLM_` prefix is a fair_sched option (`age_weight` -> `KLLM_FAIR_SCHED_AGE_WEIGHT`)."""
    tag, _, kvs = spec.partition(":")
    pairs = [kv.partition("=") for kv in kvs.split(",")]
    if not tag or not all(k.strip() and eq for k, eq, _ in pairs):
        raise ValueError(f"--variant {spec!r}: want TAG:KEY=V[,KEY=V]")
    return f"fair_sched/{tag}", {(k if k.startswith("KLLM_") else "KLLM_FAIR_SCHED_" + k).strip().upper(): v
                                 for k, _, v in pairs}


def options_label(env: dict[str, str]) -> str:
    """A variant's fair_sched options as given (`max_partial_prefills=2, ...`): `parse_variant`'s
    environment read back; other `KLLM_` settings keep their full name."""
    return ", ".join(f"{k.removeprefix('KLLM_FAIR_SCHED_').lower() if k.startswith('KLLM_FAIR_SCHED_') else k}={v}"
                     for k, v in sorted(env.items()) if k != "KLLM_FAIR_SCHED_PUBLISH_INTERVAL_S")


@dataclass
class Job:
    rid: str
    arrival_s: float
    input_ids: list[int]
    max_new_tokens: int
    kind: str  # "short" | "long"


@dataclass
class Outcome:
    rid: str
    kind: str
    prompt_len: int
    arrival_s: float
    ttft_s: float
    latency_s: float
    output_len: int
    output_ids: list[int]
    finish_reason: Any
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (SGLang's meta_info)."""

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass(frozen=True)
class Prefill:
    """A prefill server of a disaggregated pair (SGLang's `--disaggregation-mode prefill`): each
    request goes to it (not streamed) and to the decode server (streamed, timed) with the same
    bootstrap room, as a PD router sends it."""
    url: str
    host: str
    bootstrap_port: int


async def _prefill_side(session: aiohttp.ClientSession, pd: Prefill, payload: dict[str, Any]) -> None:
    async with session.post(pd.url + "/generate", json={**payload, "stream": False}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"prefill {pd.url} answered {resp.status}: {(await resp.text())[:200]}")
        await resp.read()


async def _one(session: aiohttp.ClientSession, url: str, job: Job, t0: float, pd: Prefill | None = None) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
    payload: dict[str, Any] = {
        "input_ids": job.input_ids,
        "sampling_params": {"max_new_tokens": job.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
        "rid": job.rid,
    }
    side = None
    if pd is not None:
        payload.update(bootstrap_host=pd.host, bootstrap_port=pd.bootstrap_port, bootstrap_room=random.getrandbits(63))
        side = asyncio.create_task(_prefill_side(session, pd, payload))
    r = await astream(session, url + "/generate", payload)
    if side is not None:
        await side
    if not r.ok or not r.done:
        raise RuntimeError(f"request {job.rid}: {r.error or f'status {r.status}, stream not finished'}")
    out_ids = list(r.last.get("output_ids") or [])
    return Outcome(job.rid, job.kind, len(job.input_ids), job.arrival_s, r.ttft_s, r.e2e_s, len(out_ids), out_ids,
                   r.meta.get("finish_reason"), int(r.meta.get("cached_tokens", 0) or 0))


async def _run(url: str, jobs: Sequence[Job], pd: Prefill | None = None) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # One fresh connection per request: a pooled keep-alive connection that the server closed
    # after its idle timeout fails with "Cannot write to closing transport" (it cut a run at
    # 11:17); no pool limit either, so no request waits on the client side for a connection.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(session, url, j, t0, pd) for j in jobs)))


def run_jobs(url: str, jobs: Sequence[Job], pd: Prefill | None = None) -> list[Outcome]:
    """Send `jobs` at their arrival times to the server at `url` and time them; with `pd`, `url`
    is the decode server of a disaggregated pair and `pd` its prefill server."""
    return asyncio.run(_run(url, jobs, pd))


def fair_totals(srv: Any, keys: Sequence[str]) -> dict[str, float]:
    """fair_sched's counters `keys` over all ranks (`/kllm/stats`, `SGLangServer.get_json`), 0 for
    one it lacks; {} when the server does not answer (the counters are informative only)."""
    try:
        total = srv.get_json("/kllm/stats").get("fair_sched", {}).get("total", {})
    except Exception:  # noqa: BLE001
        return {}
    return {k: float(total.get(k, 0) or 0) for k in keys}
