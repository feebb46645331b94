"""Server set-ups the conformance suite holds SGLang's own test material against.

One profile per plugin, each with the flags that make the plugin work (not inert), one with every
servable plugin together, stock SGLang as the reference, and kllm-router (bigpd_router's service)
in front of a stock server. Plugins that cannot do their work in a single CPU server are listed in
`NOT_SERVED` with the reason, and a test checks every installed plugin is in one list or the other.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from kllm_plugins.plugins.kv_tiers.testing import l3_args
from kllm_plugins.testing.sglang_server import SGLangServer, free_port

PAGE = 16
# the same on every profile, stock included, so outputs can be compared token for token
COMMON_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "1024", "--max-running-requests", "48"]
MAX_TOTAL_TOKENS = 12288  # the stress kit's multi-chunk prompt is ~8k tokens; HiCache hosts twice this

INCR_PREFIX_ARGS = ["--radix-cache-backend", "kllm_incremental"]
FAIR_SCHED_ARGS = ["--schedule-policy", "fcfs"]


# SGLang refuses a HiCache host pool unless free host RAM covers it plus a fixed 10 GiB reserve
# (sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES). The pool here is 1.25x
# the device pool (12288 tokens x 46 KB of SmolLM2 float32 K+V: 0.71 GB; the kv_tiers tests' ratio
# of 2 would take 1.13 GB), so a server with it needs about 11.5 GB free at start: a 24 GB CI machine
# running the suite (two servers and pytest, ~6 GB) leaves ~6 GB over that.
HICACHE_RATIO = "1.25"
HICACHE_RESERVE_BYTES = 10 * 1024**3
HICACHE_POOL_BYTES = int(1.25 * MAX_TOTAL_TOKENS * 30 * 2 * 3 * 64 * 4)  # SmolLM2: 30 layers, 3 KV heads x 64, f32
MEMORY_MARGIN_BYTES = 1024**3


def kv_tiers_args() -> list[str]:
    """HiCache's L2 host tier plus the plugin's checksummed L3 file store (docs/kv_tiers.md)."""
    return ["--page-size", str(PAGE), *l3_args("kllm_file"), "--hicache-ratio", HICACHE_RATIO]


def wait_for_host_memory(profile: "Profile", timeout_s: float = 300.0) -> None:
    """Before a server with a HiCache host pool starts: wait (up to timeout_s) until the host has
    the pool, SGLang's reserve and a margin free, or fail saying so (instead of SGLang's refusal)."""
    if "kv_tiers" not in profile.plugins:
        return
    import psutil

    need = HICACHE_RESERVE_BYTES + HICACHE_POOL_BYTES + MEMORY_MARGIN_BYTES
    deadline = time.monotonic() + timeout_s
    while (free := psutil.virtual_memory().available) < need:
        if time.monotonic() > deadline:
            raise RuntimeError(f"profile {profile.name}: {free / 1e9:.1f} GB of host memory free after {timeout_s:.0f} s, "
                               f"its HiCache host pool needs {need / 1e9:.1f} GB (pool + SGLang's 10 GiB reserve + margin)")
        time.sleep(2.0)


@dataclass(frozen=True)
class Profile:
    name: str
    plugins: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    router: bool = False  # kllm-router in front of the server
    page_size: int = 1
    store_dir: bool = False  # the kv_tiers store gets a fresh directory


PROFILES: dict[str, Profile] = {p.name: p for p in [
    Profile("stock"),
    Profile("trace", plugins=("trace",)),
    Profile("input_guard", plugins=("input_guard",)),
    # Python TreeCore: the one with the tail-only walk
    Profile("incr_prefix", plugins=("incr_prefix",), args=tuple(INCR_PREFIX_ARGS),
            env=(("KLLM_INCR_PREFIX_FORCE_PYTHON_TREECORE", "1"),)),
    Profile("fair_sched", plugins=("fair_sched",), args=tuple(FAIR_SCHED_ARGS)),
    Profile("kv_tiers", plugins=("kv_tiers",), page_size=PAGE, store_dir=True),
    # incr_prefix on SGLang's Rust TreeCore here (the Python walk refuses HiCache)
    Profile("all", plugins=("trace", "incr_prefix", "fair_sched", "kv_tiers", "input_guard"),
            args=tuple(INCR_PREFIX_ARGS + FAIR_SCHED_ARGS), page_size=PAGE, store_dir=True),
    Profile("router", router=True),
]}

NOT_SERVED: dict[str, str] = {
    "bigpd_router": "a service, not a server hook (its one server patch matters only on a PD prefill "
                    "server over Mooncake): held against the kits as kllm-router in front of stock "
                    "(profile 'router') and by the openai SDK, schemathesis and bench_serving",
    "ring_cp": "needs --tp-size 2 --attn-cp-size 2 --enable-prefill-cp, and the CPU platform's "
               "torch_native attention has no context-parallel call site (docs/ring_cp.md): inert here",
    "dspark": "SGLang 0.5.23 refuses DSPARK speculative decoding on devices other than CUDA/NPU/XPU "
              "(docs/dspark.md): inert on the CPU platform",
}


def server_for(profile: Profile, model_path: str | os.PathLike[str], extra: Sequence[str] = (),
               max_total_tokens: int = MAX_TOTAL_TOKENS) -> SGLangServer:
    args = list(COMMON_ARGS) + list(profile.args) + list(extra)
    if "kv_tiers" in profile.plugins:
        args += kv_tiers_args()
    env = dict(profile.env)
    if profile.store_dir:
        env["KLLM_KV_TIERS_STORE_DIR"] = tempfile.mkdtemp(prefix="kllm-conf-store-")
    return SGLangServer(model_path, plugins=profile.plugins, extra_args=args, env=env,
                        max_total_tokens=max_total_tokens, startup_timeout_s=420)


class RouterProcess:
    """`kllm-router` as a user runs it: its own process, plain workers, a loopback port."""

    def __init__(self, workers: Sequence[str], extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "kllm-router"
        self.args = [str(exe), "--host", "127.0.0.1", "--port", str(self.port), "--log-format", "text",
                     *[a for w in workers for a in ("--worker", w)], *extra]
        self.log_path = Path(tempfile.mkstemp(prefix="kllm-router-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:  # healthy once it has a healthy worker to send to
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"kllm-router not ready within {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> "RouterProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class Running:
    """What a kit talks to: `base_url` (the router's where there is one) and the server."""

    profile: Profile
    server: SGLangServer
    router: RouterProcess | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.router.base_url if self.router else self.server.base_url


def running(profile: Profile, model_path: str | os.PathLike[str], extra: Sequence[str] = (),
            max_total_tokens: int = MAX_TOTAL_TOKENS) -> Iterator[Running]:
    """Start the profile's server (and router), yield it, stop everything."""
    server = server_for(profile, model_path, extra, max_total_tokens)
    wait_for_host_memory(profile)
    server.start()
    router = None
    try:
        if profile.router:
            router = RouterProcess([server.base_url])
            router.start()
        yield Running(profile, server, router)
    finally:
        if router is not None:
            router.stop()
        server.stop()
