"""The bigpd_router SGLang adapter against the installed SGLang (no server)."""
from __future__ import annotations

import pytest

from kllm_plugins.attach import resolve_impl, resolve_target
from kllm_plugins.plugins.bigpd_router.hookimpls import kllm_declare

pytestmark = pytest.mark.sglang


def test_ledger_targets_resolve_and_the_cpu_shim_takes_effect() -> None:
    import torch

    spec = kllm_declare()
    assert spec.patches
    for patch in spec.patches:
        assert resolve_target(patch.target) is not None, patch.target
        assert patch.why and patch.upstream
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    original = MooncakeKVSender.__dict__["supports_host_tensor_indices"]
    assert original is True  # the fast path this shim exists for is still there upstream
    try:
        [patch] = spec.patches
        checker = resolve_impl(patch.impl)()
        assert checker() is True
        if not torch.cuda.is_available():
            assert MooncakeKVSender.supports_host_tensor_indices is False
        else:
            assert MooncakeKVSender.supports_host_tensor_indices is True
    finally:
        MooncakeKVSender.supports_host_tensor_indices = original
