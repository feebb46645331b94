"""incr_prefix core: staleness check, prompt-split planning, counters, config and declaration
(no SGLang)."""
from __future__ import annotations

import dataclasses

import pytest

from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
from kllm_plugins.plugins.incr_prefix.core.walk_state import (
    IncrCounters,
    Observed,
    Reason,
    WalkState,
    check_state,
    prompt_touch_depth,
)

SAVED = WalkState(node_id=7, depth=4096, epoch=2)
GOOD = Observed(last_node=7, locked_node=7, protected_len=4096, epoch=2, node_alive=True)


def test_valid_state_allows_the_tail_insert() -> None:
    assert check_state(SAVED, GOOD) is None


def test_first_checkpoint_has_no_state() -> None:
    assert check_state(None, GOOD) is Reason.NO_STATE


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": 3},  # the cache was reset
        {"last_node": 8},  # the request was re-anchored (re-admission, another match)
        {"locked_node": 8},  # the lock no longer holds the anchor
        {"locked_node": None},  # no lock at all
        {"protected_len": 4095},  # the protected prefix moved
        {"node_alive": False},  # evicted, detached or a different object under the same id
    ],
)
def test_every_mismatch_is_stale(change: dict[str, object]) -> None:
    assert check_state(SAVED, dataclasses.replace(GOOD, **change)) is Reason.STALE


def test_prompt_split_not_needed_while_the_key_is_inside_the_prompt() -> None:
    # chunked prefill: key <= prompt, stock runs no second insert
    assert prompt_touch_depth(prompt_len=8192, key_len=4096, start=2048, node_ends=None) is None
    assert prompt_touch_depth(prompt_len=8192, key_len=8192, start=4096, node_ends=None) is None
    assert prompt_touch_depth(prompt_len=0, key_len=16, start=0, node_ends=None) is None


def test_prompt_boundary_at_the_anchor_only_touches() -> None:
    # the usual finish: the last chunk protected the whole prompt, outputs follow
    assert prompt_touch_depth(prompt_len=8192, key_len=8200, start=8192, node_ends=None) == 8192


def test_prompt_boundary_on_an_earlier_node_end_only_touches() -> None:
    assert prompt_touch_depth(prompt_len=4096, key_len=9000, start=8192, node_ends=[2048, 4096, 8192]) == 4096


def test_prompt_boundary_inside_a_node_needs_the_stock_split() -> None:
    assert prompt_touch_depth(4000, 9000, 8192, [2048, 4096, 8192]) is Reason.PROMPT_SPLIT
    # boundary inside the new tail: the tail insert cannot split there itself
    assert prompt_touch_depth(8500, 9000, 8192, None) is Reason.PROMPT_SPLIT


def test_counters_split_fallbacks_from_other_full_walks() -> None:
    c = IncrCounters()
    c.record_full(Reason.NO_STATE)
    c.record_tail(new_tokens=2048, skipped=2048)
    c.record_tail(new_tokens=2048, skipped=4096)
    c.record_full(Reason.STALE)
    snap = c.snapshot()
    assert snap["tail_inserts"] == 2
    assert snap["tail_tokens"] == 4096
    assert snap["skipped_tokens"] == 6144
    assert snap["full_walks"] == 2
    assert snap["fallbacks"] == 1
    assert snap["full_by_reason"] == {"no_state": 1, "stale": 1}


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="min_prefix_tokens"):
        IncrPrefixConfig(min_prefix_tokens=-1)
    with pytest.raises(ValueError, match="publish_interval_s"):
        IncrPrefixConfig(publish_interval_s=0)


def test_plugin_declares_options_the_registry_patch_and_the_waiting_pass_hook() -> None:
    from kllm_plugins.manager import KllmPluginManager
    from kllm_plugins.plugins.incr_prefix import hookimpls

    pm = KllmPluginManager(extra_plugins=[("incr_prefix", hookimpls)], load_entry_points=False)
    spec = pm.specs["incr_prefix"]
    assert [p.kind for p in spec.patches] == ["registry", "around"]
    assert spec.patches[0].target == "sglang.srt.mem_cache.registry.register_radix_cache_backend"
    assert spec.patches[1].target == "sglang.srt.managers.schedule_policy.SchedulePolicy._compute_prefix_matches"
    (enabled,) = pm.build(["incr_prefix"], environ={"KLLM_INCR_PREFIX_MIN_PREFIX_TOKENS": "128", "KLLM_INCR_PREFIX_ENABLED": "0"})
    assert enabled.config == IncrPrefixConfig(enabled=False, min_prefix_tokens=128)


def test_exporter_publishes_counters_to_stats_and_prometheus(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    from kllm_plugins import stats
    from kllm_plugins.plugins.incr_prefix.stats_export import CounterExporter

    monkeypatch.setenv("KLLM_RUN_DIR", str(tmp_path))
    exporter = CounterExporter(IncrPrefixConfig(publish_interval_s=0.05), start_thread=False)
    before = REGISTRY.get_sample_value("kllm_incr_prefix_tail_inserts_total") or 0.0
    c = IncrCounters()
    c.record_full(Reason.NO_STATE)
    c.record_tail(new_tokens=64, skipped=64)
    exporter(c)  # the scheduler's side: marks dirty, publishes nothing yet
    assert stats.read_all(str(tmp_path)) == {}
    exporter.sync()
    c.record_tail(new_tokens=64, skipped=128)
    exporter(c)
    exporter.sync()
    total = stats.read_all(str(tmp_path))["incr_prefix"]["total"]
    assert total["tail_inserts"] == 2 and total["skipped_tokens"] == 192 and total["fallbacks"] == 0
    assert REGISTRY.get_sample_value("kllm_incr_prefix_tail_inserts_total") - before == 2
    assert REGISTRY.get_sample_value("kllm_incr_prefix_full_walks_total", {"reason": "no_state"}) >= 1
