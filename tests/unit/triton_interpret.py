"""Test helper (no SGLang): run a script in a fresh interpreter with Triton's CPU interpreter on
(TRITON_INTERPRET=1 must be set before triton is imported, hence the subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, timeout_s: float = 240) -> str:
    """Run `script` under TRITON_INTERPRET=1 and return its stdout; skip when the installed Triton
    has no interpreter, fail with the script's stderr on any other error."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KLLM_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 and "interpret" in proc.stderr.lower() and "not supported" in proc.stderr.lower():
        pytest.skip("triton interpreter unavailable: " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
