"""Unit tests of kv_tiers tier events, config, plugin declaration and the torch direct copy (no SGLang)."""
from __future__ import annotations

import importlib
import sys

import msgspec
import pytest
import torch

from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.plugins.kv_tiers import hookimpls
from kllm_plugins.plugins.kv_tiers.config import KvTiersConfig
from kllm_plugins.hardware.cpu.kv_direct_copy import transfer_kv_direct
from kllm_plugins.plugins.kv_tiers.core.file_store import FilePageStore
from kllm_plugins.plugins.kv_tiers.core.tier_events import TierEventLog, key_to_block_hash

KEY = "ff" * 32  # a SHA-256 hex storage key


def test_block_hash_matches_sglang_int64_mapping() -> None:
    assert key_to_block_hash("0000000000000001" + "0" * 48) == 1
    assert key_to_block_hash(KEY) == -1  # 0xffff... as signed int64
    assert key_to_block_hash("8000000000000000" + "0" * 48) == -(1 << 63)
    h = key_to_block_hash("not-hex")
    assert -(1 << 63) <= h < (1 << 63) and h == key_to_block_hash("not-hex")


def test_event_log_merges_bursts_and_stays_bounded() -> None:
    log = TierEventLog("host:1", block_size=16, max_events=2, max_keys_per_event=3)
    log.record("stored", "DISK", ["a"])
    log.record("stored", "DISK", ["b", "c"])
    log.record("stored", "DISK", ["d"])  # would exceed 3 keys: a new event
    log.record("removed", "DISK", ["a"])  # third event: the oldest is dropped
    events = log.take()
    assert [(e.kind, e.keys) for e in events] == [("stored", ("d",)), ("removed", ("a",))]
    assert log.dropped == 3 and log.recorded == 5
    assert log.take() == []


def test_wire_format_extends_sglang_block_events() -> None:
    log = TierEventLog("node-7:30000", block_size=16)
    log.record("stored", "DISK", [KEY, "00" * 32])
    log.record("removed", "EXTERNAL", [KEY])
    stored, removed = (e.to_wire() for e in log.take())
    assert stored["type"] == "BlockStored" and stored["medium"] == "DISK"
    assert stored["block_hashes"] == [-1, 0] and stored["storage_keys"] == [KEY, "00" * 32]
    assert stored["instance_id"] == "node-7:30000" and stored["block_size"] == 16
    assert removed == {"type": "BlockRemoved", "block_hashes": [-1], "medium": "EXTERNAL",
                       "instance_id": "node-7:30000", "storage_keys": [KEY]}
    # A consumer that only knows SGLang's fields decodes the extended map (unknown keys ignored).

    class BlockStored(msgspec.Struct, tag=True):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None = None

    got = msgspec.msgpack.decode(msgspec.msgpack.encode(stored), type=BlockStored)
    assert got.block_hashes == [-1, 0] and got.medium == "DISK"


def test_store_callbacks_feed_the_event_log(tmp_path) -> None:
    log = TierEventLog("i", 1)
    s = FilePageStore(str(tmp_path), "ns", capacity_bytes=2 * (64 + 8),
                      on_store=lambda k: log.record("stored", "DISK", [k]),
                      on_remove=lambda k: log.record("removed", "DISK", [k]))
    for k in ("a", "b", "c"):
        assert s.put(k, b"x" * 8)
    events = [(e.kind, e.keys) for e in log.take()]
    assert events == [("stored", ("a", "b")), ("removed", ("a",)), ("stored", ("c",))]


@pytest.mark.parametrize(
    "field, value",
    [("store_capacity_gb", 0), ("min_reuse", 0), ("fill_high", 1.5), ("busy_high", 0), ("fetch_margin", 0.9),
     ("explore_every", -1), ("l3_read_gbps", 0), ("prefetch_max_inflight_ops", 0)],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        KvTiersConfig(**{field: value})


def test_config_defaults_are_valid() -> None:
    c = KvTiersConfig()
    assert c.store_capacity_bytes == 16 << 30 and c.min_reuse == 2


def test_plugin_declares_options_and_a_patch_ledger(monkeypatch) -> None:
    monkeypatch.delenv("KLLM_EXTRA_PLUGINS", raising=False)
    m = KllmPluginManager(extra_plugins=[("kv_tiers", hookimpls)], load_entry_points=False)
    spec = m.specs["kv_tiers"]
    assert all(p.why and p.upstream for p in spec.patches)
    assert {p.kind for p in spec.patches} <= {"around", "after", "before", "registry"}
    built = m.build(["kv_tiers"], {}, {"KLLM_KV_TIERS_MIN_REUSE": "3", "KLLM_KV_TIERS_FSYNC": "true"}, {})
    cfg = built[0].config
    assert isinstance(cfg, KvTiersConfig) and cfg.min_reuse == 3 and cfg.fsync is True


def test_core_and_hookimpls_import_without_sglang(monkeypatch) -> None:
    for name in list(sys.modules):
        if (name.startswith(("kllm_plugins.plugins.kv_tiers", "kllm_plugins.hardware.cpu.kv_direct_copy", "sglang."))
                or name == "sglang"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    for mod in ("core.file_store", "core.page_format", "core.cost_model", "core.fetch_policy", "core.persistence",
                "core.prefetch_gate", "core.tier_events", "core.tier_state", "core.prefetch_plan", "core.write_path",
                "config", "hookimpls", "sglang_adapter", "testing"):
        importlib.import_module(f"kllm_plugins.plugins.kv_tiers.{mod}")
    importlib.import_module("kllm_plugins.hardware.cpu.kv_direct_copy")  # the platform's torch ops
    for mod in ("file_storage", "mooncake_storage"):
        with pytest.raises(ImportError):  # the backends subclass SGLang's storage classes
            importlib.import_module(f"kllm_plugins.plugins.kv_tiers.sglang_adapter.{mod}")


@pytest.mark.parametrize("page_size", [1, 4])
def test_direct_copy_moves_rows_between_layer_lists(page_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(32, 2, 8, generator=g, dtype=torch.float32).to(torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    si = torch.arange(8, 16)
    di = torch.arange(40, 48)
    transfer_kv_direct(src, dst, si, di, page_size=page_size)
    for s, d in zip(src, dst):
        assert torch.equal(d[40:48], s[8:16])
        assert d[:40].abs().sum() == 0 and d[48:].abs().sum() == 0
    with pytest.raises(ValueError):
        transfer_kv_direct(src, dst[:2], si, di)
    with pytest.raises(ValueError):
        transfer_kv_direct(src, dst, si, di[:3])


def test_direct_copy_page_first_direct_round_trip() -> None:
    from kllm_plugins.hardware.cpu.kv_direct_copy import (
        transfer_kv_all_layer_direct_lf_pf,
        transfer_kv_per_layer_direct_pf_lf,
    )

    layers, rows, heads, dim, page = 3, 64, 2, 4, 8
    g = torch.Generator().manual_seed(1)
    dev_k = [torch.randn(rows, heads, dim, generator=g) for _ in range(layers)]
    dev_v = [torch.randn(rows, heads, dim, generator=g) for _ in range(layers)]
    host_k = torch.zeros(6, layers, page, heads, dim)
    host_v = torch.zeros(6, layers, page, heads, dim)
    dev_idx = torch.arange(16, 32)  # two device pages
    host_idx = torch.arange(24, 40)  # host pages 3 and 4
    transfer_kv_all_layer_direct_lf_pf(dev_k + dev_v, [host_k, host_v], dev_idx, host_idx, page)
    for layer in range(layers):
        assert torch.equal(host_k[3, layer], dev_k[layer][16:24]) and torch.equal(host_v[4, layer], dev_v[layer][24:32])
    assert host_k[:3].abs().sum() == 0 and host_k[5].abs().sum() == 0
    back_k = torch.zeros(rows, heads, dim)
    back_v = torch.zeros(rows, heads, dim)
    transfer_kv_per_layer_direct_pf_lf([host_k, host_v], [back_k, back_v], host_idx, torch.arange(40, 56), 2, page)
    assert torch.equal(back_k[40:56], dev_k[2][16:32]) and torch.equal(back_v[40:56], dev_v[2][16:32])
