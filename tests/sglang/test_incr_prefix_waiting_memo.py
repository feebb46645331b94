"""incr_prefix waiting-queue re-match memo on real SGLang classes: SGLang's own
`SchedulePolicy.calc_priority` (lpm) runs over a waiting queue every step, with the AROUND hook
the plugin installs, against a stock cache driven identically. After every step the waiting
requests' match fields, the queue order and the whole tree (LRU order included) must be stock's,
and the memo must actually answer re-matches."""
from __future__ import annotations

from array import array

import pytest

pytest.importorskip("sglang")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.sglang

FAMILIES = [[(f * 37 + i * 11) % 97 + 1 for i in range(240)] for f in range(3)]


def _side(page_size: int, incremental: bool):  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import build_cpu_cache
    from kllm_plugins.plugins.incr_prefix.sglang_testing import CacheDriver
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    drv = CacheDriver(
        *build_cpu_cache(
            page_size=page_size, kv_size=700, max_context_len=300, max_num_reqs=6,
            incremental=incremental, config=IncrPrefixConfig() if incremental else None,
        )
    )
    policy = SchedulePolicy("lpm", drv.cache, False, False, False)
    return drv, policy


def _pass(policy, queue):  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.incr_prefix.waiting_match_memo import around_compute_prefix_matches
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    original = SchedulePolicy._compute_prefix_matches
    policy._compute_prefix_matches = lambda q, p: around_compute_prefix_matches(original, policy, q, p)
    policy.calc_priority(queue)


def _fields(r):  # type: ignore[no-untyped-def]
    return (r.rid, r.prefix_len, r.host_hit_length, r.num_matched_prefix_tokens, r.kv.cache_protected_len)


op = st.one_of(
    st.tuples(st.just("wait"), st.integers(0, 2), st.integers(0, 240), st.integers(0, 30), st.integers(0, 10**6)),
    st.tuples(st.just("admit"), st.integers(0, 7)),
    st.tuples(st.just("chunk"), st.integers(0, 5), st.integers(1, 60)),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("evict"), st.integers(1, 150)),
    st.tuples(st.just("pass"),),
    st.tuples(st.just("pass"),),
)


def _run(page_size: int, ops: list[tuple]) -> object:
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    (sd, sp), (od, op_) = _side(page_size, False), _side(page_size, True)
    waiting: list[tuple[object, object]] = []
    running: list[tuple[object, object]] = []
    n = 0
    for step in ops:
        kind = step[0]
        if kind == "wait":
            _, fam, cut, extra, seed = step
            tokens = (FAMILIES[fam][:cut] + [(seed >> i) % 90 + 200 for i in range(extra)])[:250] or [1]
            n += 1
            mk = lambda: Req(rid=f"w{n}", origin_input_text="", origin_input_ids=array("q", tokens),  # noqa: E731
                             sampling_params=SamplingParams(temperature=0, max_new_tokens=8))
            waiting.append((mk(), mk()))
        elif kind == "admit" and waiting:
            a, b = waiting.pop(step[1] % len(waiting))
            ra, rb = sd.readmit(_running(a)), od.readmit(_running(b))
            assert (ra is None) == (rb is None)
            if ra is not None:
                running.append((ra, rb))
        elif kind in ("chunk", "finish") and running:
            a, b = running[step[1] % len(running)]
            if kind == "chunk":
                if a.done < len(a.req.origin_input_ids):
                    assert sd.extend(a, step[2]) == od.extend(b, step[2])
            elif a.req.kv.kv_allocated_len > 0:  # the scheduler admits and extends together
                running.remove((a, b))
                sd.finish(a), od.finish(b)
        elif kind == "evict":
            ra = sd.cache.evict(EvictParams(num_tokens=step[1]))
            rb = od.cache.evict(EvictParams(num_tokens=step[1]))
            assert ra.num_tokens_evicted == rb.num_tokens_evicted
        elif kind == "pass":
            qa, qb = [a for a, _ in waiting], [b for _, b in waiting]
            _pass(sp, qa), _pass(op_, qb)
            assert [_fields(r) for r in qa] == [_fields(r) for r in qb]
            waiting = [next((a, b) for a, b in waiting if a is ra) for ra in qa]
        assert tree_snapshot(od.cache) == tree_snapshot(sd.cache), f"diverged after {step}"
    return od.cache


def _running(req):  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.incr_prefix.sglang_testing import Running

    return Running(req, 0)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=5, max_size=50))
def test_waiting_queue_memo_leaves_stock_results_and_tree(page_size: int, ops: list[tuple]) -> None:
    _run(page_size, ops)


def test_unchanged_tree_re_matches_come_from_the_memo_and_keep_lru_order() -> None:
    """A finished family-0 request leaves its prompt in the tree; two waiting requests match into
    it (one splits it) and one matches nothing. Passes with no tree change in between are
    answered from the memo; a chunk of another request in between must not make the memo skip
    the LRU stamp (the tree snapshot compares LRU order with stock's)."""
    ops: list[tuple] = [("wait", 0, 200, 0, 1), ("wait", 0, 150, 10, 2), ("wait", 2, 200, 0, 3), ("wait", 1, 100, 0, 4)]
    ops += [("admit", 2), ("chunk", 0, 60), ("chunk", 0, 60)]
    ops += [("admit", 0), ("chunk", 1, 100), ("chunk", 1, 100), ("finish", 1)]
    ops += [("pass",), ("pass",), ("chunk", 0, 60), ("pass",), ("pass",)]
    cache = _run(1, ops)
    c = cache.kllm_counters
    # 2 waiting requests x 4 passes: the first pass walks for each, the others hit the memo
    # (the chunk in between extends family 2, which neither waiting request's match can use).
    assert (c.rematch_done, c.rematch_skipped) == (2, 6)
