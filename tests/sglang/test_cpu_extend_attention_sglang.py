"""The CPU platform's prefix-aware extend attention against SGLang's own torch-native extend (the
function it wraps), on a batch with and without cached prefixes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_cpu_extend_attention import _batch  # noqa: E402

pytestmark = pytest.mark.sglang


def test_equals_sglangs_torch_native_extend() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from kllm_plugins.hardware.cpu.extend_attention import around_sdpa_forward_extend

    query, k, v, r2t, idx, seq, pre, new = _batch([0, 23, 9], [12, 5, 1], 4, 2, seed=3)
    ref = torch.zeros_like(query)
    TorchNativeAttnBackend._run_sdpa_forward_extend(None, query, ref, k, v, r2t, idx, seq, pre, new, None,
                                                    scaling=0.25, enable_gqa=True, causal=True)
    out = torch.zeros_like(query)
    around_sdpa_forward_extend(TorchNativeAttnBackend._run_sdpa_forward_extend, None, query, out, k, v, r2t, idx,
                               seq, pre, new, None, scaling=0.25, enable_gqa=True, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
