"""kv_tiers core: bounded calls to a store that may stall (`core/bounded_calls.py`), no SGLang.

A stalled store is a function blocked on an event; the assertions are about what the caller
gets (value, `StoreSlow`, refusal) and what is counted and logged, with time bounds far above
the timeouts used so that a loaded machine does not fail them.
"""
from __future__ import annotations

import threading
import time

import pytest

from kllm_plugins.plugins.kv_tiers.core.bounded_calls import BoundedCalls, StoreSlow

TIMEOUT_S = 0.1


def _slow_count(caplog: pytest.LogCaptureFixture) -> int:
    return sum("mooncake store slow" in r.getMessage() for r in caplog.records)


def test_answers_in_time_pass_through_values_and_errors() -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    assert b.call("lookup", lambda: 7) == 7
    with pytest.raises(KeyError):
        b.call("lookup", lambda: {}["x"])
    assert not b.slow and b.stats == {"calls": 2, "late": 0, "refused": 0, "episodes": 0, "pending": 0}


def test_a_stalled_call_is_given_up_and_later_calls_are_refused_at_once(caplog) -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    release = threading.Event()
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        with pytest.raises(StoreSlow) as late:
            b.call("lookup", lambda: release.wait(60))
        assert late.value.reason == "timeout" and b.slow
        ran = []
        for _ in range(5):  # the store has not answered the late call: nothing more is sent to it
            with pytest.raises(StoreSlow) as refused:
                b.call("lookup", lambda: ran.append(1))
            assert refused.value.reason == "slow"
            assert not b.admit("read")
    assert time.monotonic() - t0 < 10  # one timeout, then refusals without waiting (not 6 timeouts)
    assert not ran
    assert b.stats == {"calls": 1, "late": 1, "refused": 10, "episodes": 1, "pending": 0}
    assert _slow_count(caplog) == 1  # one line per episode, not per call
    release.set()


def test_the_first_answer_in_time_after_the_stall_ends_the_episode(caplog) -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    release = threading.Event()
    with pytest.raises(StoreSlow):
        b.call("lookup", lambda: release.wait(60))
    release.set()  # the store answers the late call at last
    deadline = time.monotonic() + 10
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        while True:  # the late call's thread returns shortly after: then a probe goes through
            try:
                assert b.call("lookup", lambda: "ok") == "ok"
                break
            except StoreSlow:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    assert not b.slow and b.admit("read")
    assert "store back: answered in" in caplog.text


def test_a_probe_that_is_late_again_keeps_the_episode_and_logs_nothing_new(caplog) -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    first, second = threading.Event(), threading.Event()
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        with pytest.raises(StoreSlow):
            b.call("lookup", lambda: first.wait(60))
        first.set()
        deadline = time.monotonic() + 10
        while True:
            try:
                b.call("lookup", lambda: second.wait(60))  # the probe: the store stalls again
            except StoreSlow as exc:
                if exc.reason == "timeout":
                    break
                assert time.monotonic() < deadline
                time.sleep(0.01)
    assert b.slow and b.stats["episodes"] == 1 and b.stats["late"] == 2
    assert _slow_count(caplog) == 1 and "store back: answered in" not in caplog.text
    second.set()


def test_inline_calls_start_and_end_episodes_by_their_duration(caplog) -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        assert b.admit("read")
        b.observe("read", 0.001)
        assert not b.slow
        b.observe("write", 5.0)  # an inline write that took 5 s
        assert b.slow and not b.admit("read") and not b.admit("write")
        time.sleep(0.02)
        b.observe("read", 0.001)  # begun and ended within the episode, in time
        assert not b.slow and b.admit("read")
    assert _slow_count(caplog) == 1 and "store back: answered in" in caplog.text
    assert b.stats["episodes"] == 1 and b.stats["refused"] == 2


def test_a_call_made_from_inside_a_bounded_call_runs_inline() -> None:
    b = BoundedCalls(TIMEOUT_S)
    names: list[str] = []

    def outer() -> int:
        names.append(threading.current_thread().name)
        return b.call("lookup", lambda: names.append(threading.current_thread().name) or 3)

    assert b.call("lookup", outer) == 3
    assert len(names) == 2 and names[0] == names[1] != threading.current_thread().name
    assert b.stats["calls"] == 1


def test_stuck_threads_are_bounded() -> None:
    b = BoundedCalls(TIMEOUT_S, max_late=1)
    release = threading.Event()
    with pytest.raises(StoreSlow):
        b.call("lookup", lambda: release.wait(60))
    before = threading.active_count()
    for _ in range(20):
        with pytest.raises(StoreSlow):
            b.call("lookup", lambda: release.wait(60))
    assert threading.active_count() <= before  # refused without starting threads
    release.set()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        BoundedCalls(0)
    with pytest.raises(ValueError):
        BoundedCalls(1.0, max_late=0)


def test_an_answer_to_a_call_begun_before_the_episode_does_not_end_it() -> None:
    b = BoundedCalls(5.0)
    b.observe("write", 6.0)
    b.observe("read", 2.0)  # in time, but it began 2 s before the episode did
    assert b.slow


def test_a_try_waits_only_its_own_wait_one_at_a_time_and_judges_nothing(caplog) -> None:
    """`try_call` (the scheduler thread's probe): a short wait, one unanswered try at a time, and
    an unanswered try is neither late nor the start of an episode."""
    b = BoundedCalls(10.0, name="mooncake store")
    assert b.try_call("probe", lambda: 3, 0.05) == 3
    release = threading.Event()
    t0 = time.monotonic()
    ran: list[int] = []
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        with pytest.raises(StoreSlow) as first:
            b.try_call("probe", lambda: release.wait(60), 0.05)
        with pytest.raises(StoreSlow) as second:
            b.try_call("probe", lambda: ran.append(1), 0.05)  # the first is unanswered: not started
        assert b.call("lookup", lambda: 5) == 5  # calls with the full timeout are not held up
    assert time.monotonic() - t0 < 5  # far below the 10 s timeout
    assert first.value.reason == second.value.reason == "pending" and not ran
    assert not b.slow and _slow_count(caplog) == 0
    assert b.stats["late"] == 0 and b.stats["pending"] == 2 and b.stats["episodes"] == 0
    release.set()
    assert _try_until_answered(b, "pending") == 1  # once the stuck try's thread returns, the next try runs


def _try_until_answered(b: BoundedCalls, refusal: str, within_s: float = 30.0) -> int:
    """Retry a probe until it is answered; every refusal before that must be `refusal`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return b.try_call("probe", lambda: 1, 5.0)
        except StoreSlow as exc:
            assert exc.reason == refusal and time.monotonic() < deadline
            time.sleep(0.05)


def test_a_try_during_a_slow_episode_is_refused_and_one_answered_in_time_ends_it(caplog) -> None:
    b = BoundedCalls(TIMEOUT_S, name="mooncake store")
    release = threading.Event()
    with caplog.at_level("INFO", logger="kllm.kv_tiers"):
        with pytest.raises(StoreSlow):
            b.call("lookup", lambda: release.wait(60))
        ran: list[int] = []
        with pytest.raises(StoreSlow) as refused:
            b.try_call("probe", lambda: ran.append(1), 5.0)
        assert refused.value.reason == "slow" and not ran and b.stats["refused"] == 1
        release.set()
        assert _try_until_answered(b, "slow") == 1  # the late call returns; then a try answered in time ends the episode
    assert not b.slow and "mooncake store back" in caplog.text
