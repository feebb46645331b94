"""Readiness (no SGLang): each plugin names what it needs when the server arguments leave it
inert; misspelt or misplaced option names are errors or warnings naming the nearest valid name;
the CPU platform's start-up refusals; the torch versions of HiCache's kernel I/O ops."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import KllmPluginManager

DEFAULTS = dict(enable_hierarchical_cache=False, hicache_io_backend="kernel", hicache_mem_layout="page_first",
                speculative_algorithm=None, attn_cp_size=1, enable_prefill_cp=False, cp_strategy=None,
                radix_cache_backend=None, disable_radix_cache=False, enable_unified_cache_external_linker=False,
                chunked_prefill_size=None, disaggregation_mode="null", disaggregation_transfer_backend="mooncake")


def args(**over: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**DEFAULTS, **over})


@pytest.fixture(scope="module")
def manager() -> KllmPluginManager:
    return KllmPluginManager()


def inert(manager: KllmPluginManager, name: str, server_args: Any, environ: dict[str, str] | None = None) -> str | None:
    enabled = manager.build([name], environ=environ or {})
    return manager.readiness(enabled, server_args).get(name)


# (plugin, server arguments that leave it inert, a flag the reason must name, arguments that make it work)
CASES = [
    ("kv_tiers", {}, "--enable-hierarchical-cache", {"enable_hierarchical_cache": True}),
    ("dspark", {}, "--speculative-algorithm DSPARK", {"speculative_algorithm": "DSPARK"}),
    ("ring_cp", {"attn_cp_size": 2}, "--enable-prefill-cp", {"attn_cp_size": 2, "enable_prefill_cp": True}),
    ("incr_prefix", {"radix_cache_backend": "other"}, "--radix-cache-backend kllm_incremental",
     {"radix_cache_backend": "kllm_incremental"}),
    ("fair_sched", {"chunked_prefill_size": -1}, "--chunked-prefill-size", {"chunked_prefill_size": 512}),
    ("bigpd_router", {}, "--disaggregation-mode", {"disaggregation_mode": "prefill"}),
]


@pytest.mark.parametrize("name,bad,flag,good", CASES, ids=[c[0] for c in CASES])
def test_inert_plugin_names_the_flags_that_make_it_work(manager: KllmPluginManager, name: str, bad: dict[str, Any],
                                                         flag: str, good: dict[str, Any]) -> None:
    reason = inert(manager, name, args(**bad))
    assert reason and flag in reason and "\n" not in reason
    assert inert(manager, name, args(**good)) is None


def test_trace_is_never_inert(manager: KllmPluginManager) -> None:
    assert inert(manager, "trace", args()) is None


def test_plugin_options_that_switch_it_off_are_reported(manager: KllmPluginManager) -> None:
    assert "enable-ring" in inert(manager, "ring_cp", args(attn_cp_size=2, enable_prefill_cp=True),
                                  {"KLLM_RING_CP_ENABLE_RING": "0"})
    assert "enabled is false" in inert(manager, "incr_prefix", args(radix_cache_backend="kllm_incremental"),
                                       {"KLLM_INCR_PREFIX_ENABLED": "false"})


def test_incr_prefix_selects_its_backend_only_when_none_is_given(manager: KllmPluginManager) -> None:
    enabled = manager.build(["incr_prefix"], environ={})
    sa = args()
    [(name, msg)] = manager.select_features(enabled, sa)
    assert name == "incr_prefix" and "kllm_incremental" in msg and sa.radix_cache_backend == "kllm_incremental"
    for kept in (args(radix_cache_backend="mine"), args(disable_radix_cache=True)):
        before = kept.radix_cache_backend
        assert manager.select_features(enabled, kept) == [] and kept.radix_cache_backend == before


def test_misspelt_env_var_of_an_enabled_plugin_is_an_error_naming_the_nearest(manager: KllmPluginManager) -> None:
    with pytest.raises(KllmConfigError, match="KLLM_FAIR_SCHED_BUGDET_TOKENS matches no option of plugin 'fair_sched'; "
                                              "nearest valid name: KLLM_FAIR_SCHED_BUDGET_TOKENS"):
        manager.build(["fair_sched"], environ={"KLLM_FAIR_SCHED_BUGDET_TOKENS": "1"})


def test_env_vars_of_plugins_not_enabled_are_warnings(manager: KllmPluginManager) -> None:
    manager.build(["trace"], environ={"KLLM_KV_TIERS_STORE_DIR": "/x", "KLLM_KV_TIERS_STOR_DIR": "/y", "KLLM_STRICT": "1"})
    text = "\n".join(manager.warnings)
    assert "KLLM_KV_TIERS_STORE_DIR is set but plugin 'kv_tiers' is not enabled (enabled: trace)" in text
    assert "KLLM_KV_TIERS_STOR_DIR matches no option of plugin 'kv_tiers'; nearest valid name: KLLM_KV_TIERS_STORE_DIR" in text
    assert "KLLM_STRICT" not in text  # host variables are not plugin options


def test_yaml_names_are_checked(manager: KllmPluginManager) -> None:
    with pytest.raises(KllmConfigError, match="unknown YAML section 'fair_shed'.*nearest valid name: fair_sched"):
        manager.build(["fair_sched"], environ={}, yaml_values={"fair_shed": {"budget_tokens": 1}})
    with pytest.raises(KllmConfigError, match=r"unknown YAML key kv_tiers\.store_dri.*nearest valid name: store_dir"):
        manager.build(["trace"], environ={}, yaml_values={"kv_tiers": {"store_dri": "/x"}})
    manager.build(["trace"], environ={}, yaml_values={"kv_tiers": {"store_dir": "/x"}})
    assert any("YAML section 'kv_tiers' is given but plugin 'kv_tiers' is not enabled" in w for w in manager.warnings)


def test_cli_option_of_a_plugin_not_enabled_is_an_error(manager: KllmPluginManager) -> None:
    with pytest.raises(KllmConfigError, match="--kllm-kv-tiers-store-dir is an option of plugin 'kv_tiers', which is not "
                                              r"enabled \(enabled: fair_sched\); add kv_tiers to --enable-plugin"):
        manager.build(["fair_sched"], cli_values={"kllm_kv_tiers_store_dir": "/nonexistent/x"}, environ={})


# -- the CPU platform ---------------------------------------------------------------------------

def test_cpu_platform_refuses_hicache_pairs_without_a_torch_copy() -> None:
    from kllm_plugins.hardware.cpu.server_args_check import HICACHE_WORKING, check

    for io, layout in HICACHE_WORKING:
        assert check(args(enable_hierarchical_cache=True, hicache_io_backend=io, hicache_mem_layout=layout)) is None
    reason = check(args(enable_hierarchical_cache=True, hicache_io_backend="kernel", hicache_mem_layout="page_head"))
    assert reason and "page_head" in reason and "\n" not in reason
    assert all(f"--hicache-io-backend {io} --hicache-mem-layout {layout}" in reason for io, layout in HICACHE_WORKING)
    assert check(args(hicache_mem_layout="page_head")) is None  # HiCache off: nothing to refuse


def test_cpu_platform_refuses_context_parallelism() -> None:
    from kllm_plugins.hardware.cpu.server_args_check import check

    reason = check(args(attn_cp_size=2))
    assert reason and "--attn-cp-size 2" in reason and "torch_native" in reason
    assert check(args(attn_cp_size=1)) is None


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def test_kernel_ops_copy_the_rows_they_are_given() -> None:
    from kllm_plugins.hardware.cpu import kv_kernel_copy as k

    torch.manual_seed(0)
    layers, size, heads, dim = 3, 40, 2, 4
    dev_k = [torch.randn(size, heads, dim) for _ in range(layers)]
    dev_v = [torch.randn(size, heads, dim) for _ in range(layers)]
    item = heads * dim * 4
    si, di = torch.tensor([3, 7, 8, 20]), torch.tensor([0, 5, 6, 39])

    # device -> layer-first host (pointer tables on both sides), then back one layer at a time
    host = torch.zeros(2, layers, size, heads, dim)
    k.transfer_kv_all_layer(_ptrs(dev_k), _ptrs(list(host[0])), _ptrs(dev_v), _ptrs(list(host[1])), si, di, item, layers)
    for layer in range(layers):
        assert torch.equal(host[0, layer][di], dev_k[layer][si]) and torch.equal(host[1, layer][di], dev_v[layer][si])
    untouched = torch.ones(size, dtype=torch.bool)
    untouched[di] = False
    assert not host[:, :, untouched].any()
    back_k, back_v = torch.zeros(size, heads, dim), torch.zeros(size, heads, dim)
    k.transfer_kv_per_layer(host[0, 1], back_k, host[1, 1], back_v, di, si, item)
    assert torch.equal(back_k[si], dev_k[1][si]) and torch.equal(back_v[si], dev_v[1][si])

    # device -> page-first host ([tokens, layers, heads, dim]), then back
    pf = torch.zeros(2, size, layers, heads, dim)
    k.transfer_kv_all_layer_lf_pf(_ptrs(dev_k), pf[0], _ptrs(dev_v), pf[1], si, di, item, layers * item, layers)
    for layer in range(layers):
        assert torch.equal(pf[0][di, layer], dev_k[layer][si]) and torch.equal(pf[1][di, layer], dev_v[layer][si])
    back_k.zero_()
    back_v.zero_()
    k.transfer_kv_per_layer_pf_lf(pf[0], back_k, pf[1], back_v, di, si, 2, item, layers * item)
    assert torch.equal(back_k[si], dev_k[2][si]) and torch.equal(back_v[si], dev_v[2][si])
