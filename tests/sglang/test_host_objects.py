"""Real SGLang objects with the hooks applied (in a child process, so patches never leak)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.sglang

SCRIPT = textwrap.dedent(
    """
    import os, pickle, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()                                   # what every SGLang process does first
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.managers.scheduler import Scheduler
    from kllm_plugins import runtime
    from kllm_plugins.sglang_bridge import host

    # kept in a list: SGLang's _propagate_patch rebinds module globals that hold the original
    before = [Scheduler.__dict__["get_next_batch_to_run"]]
    sa = prepare_server_args(["--model-path", "dummy", "--enable-plugin", "trace",
                              "--kllm-trace-log-interval-s", "3"])
    assert sa._kllm_plugins == ["trace"], sa._kllm_plugins
    assert os.environ["KLLM_PLUGINS"] == "trace"
    assert os.environ["KLLM_TRACE_LOG_INTERVAL_S"] == "3"
    assert runtime.config_of("trace").log_interval_s == 3.0
    after = Scheduler.__dict__["get_next_batch_to_run"]
    assert after is not before[0] and after.__wrapped__ is before[0]
    # the bookkeeping attribute travels to subprocesses with the pickled record
    assert pickle.loads(pickle.dumps(sa))._kllm_plugins == ["trace"]
    results = [r for rep in host().reports for r in rep.results]
    assert results and all(r.ok for r in results), results
    print("OK", len(results))
    """
)


def test_cli_hooks_enable_plugin_in_launcher_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLLM_") and k != "SGLANG_USE_CPU_ENGINE"}
    env.update({"SGLANG_PLATFORM": "kllm_cpu", "KLLM_STRICT": "1"})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the host's own hooks, the CPU platform's list and the trace plugin's
    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.platform_patches import platform_patches
    from kllm_plugins.sglang_bridge import HOST_PATCHES

    n = len(HOST_PATCHES) + len(platform_patches("kllm_cpu")) + len(KllmPluginManager().specs["trace"].patches)
    assert out.stdout.split()[-2:] == ["OK", str(n)]
