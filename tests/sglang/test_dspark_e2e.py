"""End to end: a real sglang.launch_server on the CPU platform with the dspark plugin enabled.

SGLang's DSPARK cannot run on CPU (its resolution refuses devices other than CUDA/NPU/XPU), so
this server is not speculative. What it shows: every dspark hook resolves and attaches in the
launcher and in SGLang's spawned processes, the ragged-verify default reaches the children's
environment, the plugin says it is inert (not speculative: KLLM_STRICT=1 would refuse to start,
tests/sglang/test_plugin_readiness_e2e.py), and serving is unaffected.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kllm_plugins.testing.sglang_server import SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


def test_server_attaches_every_dspark_hook_in_every_process(tiny_model_path: Path) -> None:
    env = {
        # Not yet an entry point of the package: register the module directly.
        "KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.dspark.hookimpls",
        "KLLM_DSPARK_MIN_VERIFY_LEN": "2",
    }
    with SGLangServer(tiny_model_path, plugins=["dspark"], env=env, strict=False) as srv:
        out = srv.post_json("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert out.get("text") is not None
        assert srv.get_json("/kllm/plugins")["state"]["dspark"].startswith("inert: ")
        sub = srv.grep_log(r"kllm-plugins .* active \(role=subprocess")
        main = srv.grep_log(r"kllm dspark: ragged verify mode=")
    assert len(sub) >= 2 and all("dspark" in line for line in sub)
    # the host's hooks, the CPU platform's list and every dspark ledger entry, verified in each
    # spawned process
    from kllm_plugins.plugins.dspark.hookimpls import kllm_declare
    from kllm_plugins.platform_patches import platform_patches
    from kllm_plugins.sglang_bridge import HOST_PATCHES

    n = len(HOST_PATCHES) + len(platform_patches("kllm_cpu")) + len(kllm_declare().patches)
    assert all(f"hooks applied {n}/{n}" in line for line in sub), sub
    assert main and "mode=compact" in main[0] and "verify_len=[2," in main[0]
