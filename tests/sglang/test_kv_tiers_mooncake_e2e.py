"""End to end: SGLang's own Mooncake HiCache backend on the CPU platform, master started here.

kv_tiers' CPU compatibility hooks (unpinned host pool, torch page_first_direct copies) are what
let HiCache run on this platform; the Mooncake store itself is stock SGLang with the non-CUDA
transfer engine over TCP. After a flush of L1 and L2 the prefix must come back from Mooncake
(prefetch loaded, cached tokens) with the same greedy output.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.sglang_server import SGLangServer, free_port

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

PROMPT = list(range(10, 310))


@pytest.fixture()
def mooncake_master(tmp_path) -> Iterator[tuple[int, int]]:
    pytest.importorskip("mooncake.store")
    if shutil.which("mooncake_master") is None:
        pytest.skip("mooncake_master not installed (pip mooncake-transfer-engine-non-cuda)")
    rpc, http = free_port(), free_port()
    proc = subprocess.Popen(
        ["mooncake_master", f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
         f"-http_metadata_server_port={http}"],
        stdout=open(tmp_path / "master.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    time.sleep(2)
    assert proc.poll() is None, (tmp_path / "master.log").read_text()
    try:
        yield rpc, http
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def _flush(server: SGLangServer, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{server.base_url}/flush_cache", data=b"", timeout=60):
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_mooncake_l3_serves_prefix_after_flush(mooncake_master: tuple[int, int]) -> None:
    rpc, http = mooncake_master
    extra = {"master_server_address": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
             "protocol": "tcp", "device_name": "", "global_segment_size": 256 << 20, "local_hostname": "127.0.0.1"}
    args = ["--page-size", "16", "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--hicache-write-policy", "write_through",
            "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    env = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls", "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "false"}
    with SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=args, env=env,
                      startup_timeout_s=300) as server:
        ref = server.generate(input_ids=PROMPT, max_new_tokens=6)["output_ids"]
        time.sleep(1.5)  # write-through to Mooncake runs on the backup thread
        _flush(server)
        again = server.generate(input_ids=PROMPT, max_new_tokens=6)
        assert again["output_ids"] == ref
        assert again["meta_info"]["cached_tokens"] >= 288
        loaded = [line for line in server.grep_log(r"HiCache prefetch success") if "loaded=288" in line]
        assert loaded, server.log_tail(30)
        assert server.grep_log(r"Mooncake store setup successfully")
