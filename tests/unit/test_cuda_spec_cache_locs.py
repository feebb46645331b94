"""kllm_cuda hands SGLang its own Triton kernel for speculative write windows (SGLang's `is_cuda()`
gate is False there, and without the platform function DSPARK's verify window is None). Runs the
kernel under Triton's interpreter on the CPU, in a subprocess (the interpreter is chosen at import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK = r"""
import json, torch
from kllm_plugins.hardware.cuda.spec_cache_locs import assign_extend_cache_locs
g = torch.Generator().manual_seed(0)
req_to_token = torch.randint(0, 10_000, (6, 64), generator=g, dtype=torch.int32)
reqs = torch.tensor([4, 0, 5], dtype=torch.int64)
start = torch.tensor([3, 17, 40], dtype=torch.int64)
width = 7
out = assign_extend_cache_locs(req_pool_indices=reqs, req_to_token=req_to_token, start_offset=start,
                               end_offset=start + width, batch_size=3, draft_token_num=width, device="cpu")
want = torch.cat([req_to_token[r, s:s + width] for r, s in zip(reqs.tolist(), start.tolist())]).long()
empty = assign_extend_cache_locs(req_pool_indices=reqs[:0], req_to_token=req_to_token, start_offset=start[:0],
                                 end_offset=start[:0], batch_size=0, draft_token_num=width, device="cpu")
print("RESULT " + json.dumps({"equal": bool(torch.equal(out, want)), "dtype": str(out.dtype),
                              "n": out.numel(), "empty": empty.numel()}))
"""


def test_platform_cache_locs_fn_is_sglangs_kernel_and_exact() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("sglang.kernels.ops.speculative.cache_locs")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    got = json.loads(lines[0])
    assert got == {"equal": True, "dtype": "torch.int64", "n": 21, "empty": 0}


def test_the_platform_returns_the_function() -> None:
    pytest.importorskip("sglang.srt.platforms.cuda")
    from kllm_plugins.hardware.cuda.sglang_platform import KllmCudaPlatform
    from kllm_plugins.hardware.cuda.spec_cache_locs import assign_extend_cache_locs

    # the hook reads nothing of the instance (building one needs a GPU)
    assert KllmCudaPlatform.get_speculative_cache_locs_fn(None) is assign_extend_cache_locs  # type: ignore[arg-type]
