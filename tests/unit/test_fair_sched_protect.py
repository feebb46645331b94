"""Unit tests of fair_sched's decode KV protection core, config and declaration (no SGLang)."""
from __future__ import annotations

import builtins
import importlib
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kllm_plugins.errors import KllmConfigError
from kllm_plugins.manager import KllmPluginManager
from kllm_plugins.plugins.fair_sched import hookimpls
from kllm_plugins.plugins.fair_sched.config import FairSchedConfig
from kllm_plugins.plugins.fair_sched.core.repetition import RepetitionDetector, find_loop
from kllm_plugins.plugins.fair_sched.core.watermark import WatermarkGate, continuation_tokens


def test_watermark_pauses_above_high_and_resumes_only_below_low() -> None:
    gate = WatermarkGate(high=0.9, low=0.7)
    seen = [gate.update(used, 100) for used in (50, 89, 90, 95, 80, 71, 70, 69, 85, 90)]
    assert seen == [True, True, False, False, False, False, False, True, True, False]
    assert (gate.pauses, gate.resumes, gate.blocked_passes) == (2, 1, 6)
    assert gate.state()["admission_paused"] is True


@settings(max_examples=200, deadline=None)
@given(st.floats(0.05, 1.0), st.floats(0.0, 0.99), st.lists(st.integers(0, 1000), max_size=60))
def test_watermark_hysteresis_property(high: float, low_frac: float, usages: list[int]) -> None:
    low = high * low_frac
    gate = WatermarkGate(high=high, low=low)
    paused = False
    for used in usages:
        u = used / 1000
        before = paused
        allowed = gate.update(used, 1000)
        if not before and u >= high:
            paused = True
        elif before and u < low:
            paused = False
        assert allowed is (not paused)
        # State changes only across a threshold: never closes below high, never opens at or above low.
        if paused and not before:
            assert u >= high
        if before and not paused:
            assert u < low


@pytest.mark.parametrize("high,low", [(0.0, 0.0), (1.2, 0.5), (0.8, 0.8), (0.8, -0.1)])
def test_watermark_rejects_bad_thresholds(high: float, low: float) -> None:
    with pytest.raises(ValueError, match="watermark"):
        WatermarkGate(high=high, low=low)


def test_continuation_chunk_examples() -> None:
    # budget left: SGLang's own answer (the smaller of the chunk and the budget)
    assert continuation_tokens(2048, 5000, 100, 1) == 2048
    assert continuation_tokens(2048, 700, 100, 1) == 700
    # spent budget: SGLang 0.5.23 would hand out 2048 with 869 free (the H200 crash); cut to what fits
    assert continuation_tokens(2048, 0, 869, 1) == 867
    assert continuation_tokens(2048, -300, 4096, 1) == 2048
    assert continuation_tokens(2048, 0, 869, 16) == 832  # whole pages, two pages of slack
    # nothing fits: sit the pass out
    assert continuation_tokens(2048, 0, 2, 1) is None
    assert continuation_tokens(2048, 0, 40, 16) is None
    with pytest.raises(ValueError):
        continuation_tokens(0, 0, 10, 1)
    # a decode reserve (60 running rows x 8 steps): the chunk leaves that much for the next decode steps
    assert continuation_tokens(512, 0, 900, 1, decode_reserve=480) == 418  # 900 - 2 slack - 480
    assert continuation_tokens(512, 0, 1000, 1, decode_reserve=480) == 512
    assert continuation_tokens(512, 0, 400, 1, decode_reserve=480) is None  # sits out while they decode
    assert continuation_tokens(512, 0, 4096, 16, decode_reserve=20) == 512  # rounded up to 2 pages of reserve
    assert continuation_tokens(512, 700, 400, 1, decode_reserve=480) == 512  # budget left: SGLang's answer
    with pytest.raises(ValueError):
        continuation_tokens(512, 0, 10, 1, decode_reserve=-1)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 1 << 16), st.integers(-(1 << 16), 1 << 16), st.integers(0, 1 << 17), st.sampled_from([1, 2, 16, 64]),
       st.integers(0, 1 << 12))
def test_continuation_chunk_never_overruns_the_free_kv(chunk: int, left: int, free: int, page: int, reserve: int) -> None:
    n = continuation_tokens(chunk, left, free, page, decode_reserve=reserve)
    if left > 0:  # SGLang's budget (left <= free: it is free minus reservations) stands
        assert n == min(chunk, left)
        return
    kept = 2 * page + -(-reserve // page) * page  # slack pages plus the decode reserve, in whole pages
    if n is None:
        assert free < kept + page  # not one page beyond the slack and the reserve
        return
    assert 0 < n <= chunk
    assert n + kept <= free  # the allocation, rounded up to pages, fits with the reserve left
    assert n == chunk or n % page == 0


def test_loop_detector_examples() -> None:
    det = RepetitionDetector(min_loop_tokens=8, max_period=3)
    assert det.extend([5, 6, 7, 8, 9, 1, 2, 1, 2, 1, 2]) is None  # 1,2 x3 = 6 tokens periodic
    assert det.push(1) is None  # 7
    assert det.push(2) == (2, 8)
    one = RepetitionDetector(min_loop_tokens=4, max_period=2)
    assert one.extend([3, 3, 3]) is None
    assert one.push(3) == (1, 4)


def test_restarted_detector_judges_only_new_tokens() -> None:
    det = RepetitionDetector(min_loop_tokens=6, max_period=2)
    assert det.extend([9] * 6) == (1, 6)
    det.restart()
    # The kept output ends in the loop, but the next verdict needs six new looping tokens.
    assert [det.push(9) for _ in range(6)] == [None] * 5 + [(1, 6)]
    det.restart()
    assert det.extend([1, 2, 3, 4, 5, 6, 7]) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.integers(4, 12), st.integers(1, 6))
def test_incremental_detector_matches_reference(tokens: list[int], min_loop: int, period: int) -> None:
    period = min(period, min_loop // 2)
    det = RepetitionDetector(min_loop, period)
    for i, t in enumerate(tokens):
        assert det.push(t) == find_loop(tokens[: i + 1], min_loop, period)


def test_config_defaults_and_quota_params() -> None:
    cfg = FairSchedConfig()
    qp = cfg.quota_params(128, page_size=16)
    assert (qp.budget_tokens, qp.base_quota_tokens, qp.max_quota_tokens, qp.page_size) == (128, 128, 512, 16)
    assert qp.decode_every_chunks == cfg.decode_every_chunks
    # Riding earlier-key requests get three budgets on top by default (-1); 0 turns riding off.
    assert (qp.short_extra_tokens, qp.age_weight, qp.decode_share) == (384, cfg.age_weight, cfg.decode_share)
    assert FairSchedConfig(short_extra_tokens=0).quota_params(128).short_extra_tokens == 0
    assert FairSchedConfig(short_extra_tokens=48, decode_interval_s=0.3).quota_params(128).decode_interval_s == 0.3
    qp2 = FairSchedConfig(budget_tokens=256, base_quota_tokens=64, max_quota_tokens=300).quota_params(128)
    assert (qp2.budget_tokens, qp2.base_quota_tokens, qp2.max_quota_tokens) == (256, 64, 300)


@pytest.mark.parametrize("field,value", [
    ("quota_growth", 0.5), ("long_min_share", 0.0), ("kv_high_watermark", 1.5), ("kv_low_watermark", 0.99),
    ("loop_action", "explode"), ("max_yields", -1), ("budget_tokens", 1), ("loop_min_tokens", 1),
    ("decode_every_chunks", -2), ("publish_interval_s", 0.0), ("loop_max_retracts", -1),
    ("short_extra_tokens", -2), ("age_weight", -1.0), ("decode_share", 1.0), ("decode_interval_s", -0.1),
    ("busy_decode_reqs", -1), ("decode_max_gap_s", -0.1),
])
def test_config_errors_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        FairSchedConfig(**{field: value})


def _manager() -> KllmPluginManager:
    return KllmPluginManager(extra_plugins=[("fair_sched", hookimpls)], load_entry_points=False)


def test_options_reach_the_config_through_env_and_cli() -> None:
    m = _manager()
    [ep] = m.build(
        ["fair_sched"],
        {"kllm_fair_sched_quota_growth": "2.5"},
        {"KLLM_FAIR_SCHED_KV_HIGH_WATERMARK": "0.9", "KLLM_FAIR_SCHED_QUOTA_GROWTH": "9"},
    )
    assert ep.config.quota_growth == 2.5 and ep.config.kv_high_watermark == 0.9


def test_bad_option_is_a_one_line_startup_error() -> None:
    with pytest.raises(KllmConfigError, match="kv_low_watermark") as exc:
        _manager().build(["fair_sched"], {}, {"KLLM_FAIR_SCHED_KV_LOW_WATERMARK": "0.99"})
    assert "\n" not in str(exc.value)
    with pytest.raises(KllmConfigError, match="LOOP_ACTION.*valid choices: finish"):
        _manager().build(["fair_sched"], {}, {"KLLM_FAIR_SCHED_LOOP_ACTION": "explode"})


def test_every_patch_target_is_declared_with_reason_and_upstream() -> None:
    spec = hookimpls.kllm_declare()
    assert spec.name == "fair_sched"
    for patch in spec.patches:
        assert patch.target.startswith("sglang.srt.") and patch.why and patch.upstream
        module, func = patch.impl.split(":")
        # the SGLang adapter modules (the only ones that touch SGLang objects)
        assert module in tuple(f"kllm_plugins.plugins.fair_sched.sglang_{m}" for m in ("adapter", "partials", "loops", "interval"))
        src = importlib.util.find_spec(module)
        assert src is not None and src.origin is not None
        assert f"def {func}(" in open(src.origin, encoding="utf-8").read()


def test_core_and_hookimpls_import_without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def guarded(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"sglang import blocked: {name}")
        return real_import(name, *args, **kwargs)

    names = [n for n in sys.modules if n.startswith("kllm_plugins.plugins.fair_sched") and not n.endswith("sglang_adapter")]
    for n in names:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.setattr(builtins, "__import__", guarded)
    for mod in ("core", "core.quota", "core.watermark", "core.repetition", "core.simulate", "config", "hookimpls"):
        importlib.import_module(f"kllm_plugins.plugins.fair_sched.{mod}")
