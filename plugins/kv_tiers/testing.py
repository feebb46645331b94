"""Layer: test tooling of the kv_tiers plugin (no SGLang import at module level; never on the
server path): a Mooncake master started and stopped by the caller, HiCache flags for each L3
backend, a cache flush that waits out in-flight storage operations, and polling of the plugin's
`/kllm/stats` snapshot. Used by tests/sglang/test_kv_tiers_* (and other e2e tests that start a
kv_tiers server) and benchmarks/kv_tiers/."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kllm_plugins.testing.sglang_server import flush_cache, free_port

ADAPTER = "kllm_plugins.plugins.kv_tiers.sglang_adapter"  # module_path of both backends
FILE_ADAPTER = MOONCAKE_ADAPTER = ADAPTER
# an explicit --hicache-ratio: SGLang's automatic host sizing refuses to start when the shared
# machine has less than 10 GiB free, though the tiny model needs a few MiB
HICACHE_ARGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-write-policy",
                "write_through", "--hicache-ratio", "2"]
LAYER_FIRST = ["--hicache-mem-layout", "layer_first"]
# Mooncake's zero-copy path needs a page's K (and V) contiguous in the host pool (MHA models)
PAGE_FIRST = ["--hicache-mem-layout", "page_first_direct"]


def mooncake_master_path() -> str | None:
    """The `mooncake_master` executable: on PATH, or beside this interpreter (a virtual
    environment's scripts when its python runs without the environment activated, as CI does)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return mooncake_master_path() is not None


@contextmanager
def mooncake_master(*flags: str) -> Iterator[dict[str, Any]]:
    """A `mooncake_master` (non-CUDA build, TCP, HTTP metadata server) on free ports."""
    # the metrics/admin server defaults to port 9003: a free one, so that two masters (or anything
    # else on 9003) never collide
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)
    exe = mooncake_master_path()
    if exe is None:
        raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
    proc = subprocess.Popen([exe, f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                             f"-http_metadata_server_port={http}",
                             f"-metrics_port={metrics}", *flags],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start (log {log.name})")
            time.sleep(0.2)
    try:
        yield {"rpc": rpc, "http": http, "proc": proc, "log": log.name}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)


def mooncake_extra(master: dict[str, Any], segment_bytes: int = 256 << 20) -> dict[str, Any]:
    """Mooncake client keys of the HiCache extra config for a master from `mooncake_master`."""
    return {"master_server_address": f"127.0.0.1:{master['rpc']}",
            "metadata_server": f"http://127.0.0.1:{master['http']}/metadata", "protocol": "tcp",
            "device_name": "", "global_segment_size": segment_bytes, "local_hostname": "127.0.0.1"}


def l3_args(backend: str, master: dict[str, Any] | None = None, **extra: Any) -> list[str]:
    """HiCache flags for an L3 backend: "kllm_file", "kllm_mooncake" (the plugin's), "file" or
    "mooncake" (SGLang's own)."""
    if backend == "kllm_file":
        cfg = {"backend_name": "kllm_file", "module_path": FILE_ADAPTER, "class_name": "KllmFileStorage",
               "hicache_storage_pass_prefix_keys": True, **extra}
        return HICACHE_ARGS + LAYER_FIRST + ["--hicache-storage-backend", "dynamic",
                                             "--hicache-storage-backend-extra-config", json.dumps(cfg)]
    if backend == "kllm_mooncake":
        assert master is not None
        cfg = {"backend_name": "kllm_mooncake", "module_path": MOONCAKE_ADAPTER, "class_name": "KllmMooncakeStorage",
               "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, **mooncake_extra(master), **extra}
        return HICACHE_ARGS + PAGE_FIRST + ["--hicache-storage-backend", "dynamic",
                                            "--hicache-storage-backend-extra-config", json.dumps(cfg)]
    if backend == "mooncake":
        assert master is not None
        return HICACHE_ARGS + PAGE_FIRST + ["--hicache-storage-backend", "mooncake",
                                            "--hicache-storage-backend-extra-config",
                                            json.dumps({**mooncake_extra(master), **extra})]
    if backend == "file":
        cfg_args = ["--hicache-storage-backend-extra-config", json.dumps(extra)] if extra else []
        return HICACHE_ARGS + LAYER_FIRST + ["--hicache-storage-backend", "file", *cfg_args]
    raise ValueError(f"unknown L3 backend {backend!r}")


def flush(base_url: str, timeout_s: float = 60.0) -> None:
    """Flush L1 and L2 of a server (retrying while storage operations are in flight)."""
    flush_cache(base_url, timeout_s, retry_s=1.0)


def kv_tiers_stats(server: Any) -> dict[str, Any]:
    """The kv_tiers snapshot of a one-process server from GET /kllm/stats ({} if none yet)."""
    procs = server.get_json("/kllm/stats").get("kv_tiers", {}).get("processes", {})
    return next(iter(procs.values()), {})


def wait_stats(server: Any, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
    """Poll `kv_tiers_stats` until `pred` holds or `timeout_s` passes; the last snapshot either way
    (the caller asserts on it, so a timeout shows what was reached)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = kv_tiers_stats(server)
        if (snap and pred(snap)) or time.monotonic() > deadline:
            return snap
        time.sleep(0.3)



def assert_loads_from_l3(server: Any, prompt: list[int], ref: list[int], pages: int, page_size: int,
                         timeout_s: float) -> None:
    """Flush `server`'s device and host caches, send `prompt` again and assert that its output is `ref`
    and that at least `pages` pages came from L3 (cached tokens, store hits, no store fault)."""
    flush(server.base_url)
    out = server.generate(input_ids=prompt, max_new_tokens=len(ref))
    assert out["output_ids"] == ref
    assert out["meta_info"]["cached_tokens"] >= pages * page_size, out["meta_info"]
    snap = wait_stats(server, lambda s: s["store"]["hits"] >= pages, timeout_s)
    assert snap["store"]["hits"] >= pages and not snap["store"]["faults"], snap


def mha_host_pool(layout: str, pages: int, layers: int = 4, page_size: int = 16, heads: int = 2,
                  head_dim: int = 8, dtype: Any = None, seed: int = 0) -> Any:
    """SGLang's `MHATokenToKVPoolHost` with its page methods (get_data_page, set_from_flat_data_page,
    get_dummy_flat_data_page) as shipped, over a random host buffer in `layout` (layer_first,
    page_first, page_first_direct), built without a device pool: only what those methods read is set."""
    import torch
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    pool = object.__new__(MHATokenToKVPoolHost)
    pool.layout, pool.page_size, pool.layer_num, pool.head_num, pool.head_dim = layout, page_size, layers, heads, head_dim
    pool.size, pool.page_num, pool.device, pool.pin_memory = pages * page_size, pages, "cpu", False
    pool.dtype = dtype or torch.bfloat16
    shape = {"layer_first": (2, layers, pages * page_size, heads, head_dim),
             "page_first": (2, pages * page_size, layers, heads, head_dim),
             "page_first_direct": (2, pages, layers, page_size, heads, head_dim)}[layout]
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer = torch.randn(shape, generator=g).to(pool.dtype)
    return pool
