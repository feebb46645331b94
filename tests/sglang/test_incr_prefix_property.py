"""incr_prefix on real SGLang caches: the incremental cache must leave exactly the tree the stock
UnifiedRadixCache leaves, step by step, over random interleavings of admissions (with shared
prefixes), chunk checkpoints, decode, finishes, aborts, retractions and evictions."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.sglang

KV_SIZE = 900
MAX_REQS = 6
MAX_CTX = 400


def _pair(page_size: int, tree_core: str = "python"):  # type: ignore[no-untyped-def]
    from kllm_plugins.plugins.incr_prefix.config import IncrPrefixConfig
    from kllm_plugins.plugins.incr_prefix.sglang_adapter import build_cpu_cache
    from kllm_plugins.plugins.incr_prefix.sglang_testing import CacheDriver

    stock = CacheDriver(
        *build_cpu_cache(
            page_size=page_size, kv_size=KV_SIZE, max_context_len=MAX_CTX, max_num_reqs=MAX_REQS, tree_core=tree_core
        )
    )
    ours = CacheDriver(
        *build_cpu_cache(
            page_size=page_size,
            kv_size=KV_SIZE,
            max_context_len=MAX_CTX,
            max_num_reqs=MAX_REQS,
            tree_core=tree_core,
            incremental=True,
            config=IncrPrefixConfig(),
        )
    )
    return stock, ours


# A few prompt families so that requests share prefixes of random lengths and split each
# other's nodes; a request is a family prefix followed by its own suffix.
FAMILIES = [[(f * 37 + i * 11) % 97 + 1 for i in range(300)] for f in range(3)]

admit = st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 300), st.integers(0, 120), st.integers(0, 10**6))
chunk = st.tuples(st.just("chunk"), st.integers(0, 7), st.integers(1, 70))
op = st.one_of(
    admit,
    chunk,
    st.tuples(st.just("decode"), st.integers(0, 7), st.integers(1, 6)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("retract"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 200)),
    st.tuples(st.just("match"), st.integers(0, 2), st.integers(1, 300)),
)
# Admissions first, then mostly chunks: a chunked prefill is many checkpoints per request.
scenario = st.tuples(
    st.lists(admit, min_size=1, max_size=3),
    st.lists(st.one_of(chunk, chunk, chunk, op), min_size=5, max_size=60),
).map(lambda t: t[0] + t[1])


def _run(page_size: int, ops: list[tuple], tree_core: str = "python") -> tuple[object, object]:
    from kllm_plugins.plugins.incr_prefix.sglang_testing import tree_snapshot
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stock, ours = _pair(page_size, tree_core)
    running: list[tuple[object, object]] = []  # (stock Running, ours Running)
    retracted: list[tuple[object, object]] = []
    n = 0
    for step in ops:
        kind = step[0]
        if kind == "admit":
            _, fam, cut, extra, seed = step
            if retracted and seed % 3 == 0:
                pair = retracted.pop(0)
                a, b = stock.readmit(pair[0]), ours.readmit(pair[1])
            else:
                tokens = FAMILIES[fam][:cut] + [(seed >> i) % 90 + 200 for i in range(extra)]
                tokens = tokens[: MAX_CTX - 40] or [1]
                n += 1
                a, b = stock.admit(f"r{n}", tokens), ours.admit(f"r{n}", tokens)
            assert (a is None) == (b is None)
            if a is not None:
                running.append((a, b))
        elif kind in ("chunk", "decode", "finish", "abort", "retract") and running:
            a, b = running[step[1] % len(running)]
            if kind == "chunk":
                if a.done < len(a.req.origin_input_ids):
                    assert stock.extend(a, step[2]) == ours.extend(b, step[2])
            elif kind == "decode":
                if a.done == len(a.req.origin_input_ids) and len(a.req.origin_input_ids) + len(a.outputs) + step[2] < MAX_CTX:
                    for t in range(step[2]):
                        assert stock.decode(a, 300 + t) == ours.decode(b, 300 + t)
            elif a.req.kv.kv_allocated_len > 0:  # the scheduler admits and extends together
                running.remove((a, b))
                if kind == "finish":
                    stock.finish(a), ours.finish(b)
                elif kind == "abort":
                    stock.abort(a), ours.abort(b)
                else:
                    stock.retract(a), ours.retract(b)
                    retracted.append((a, b))
        elif kind == "evict":
            ra = stock.cache.evict(EvictParams(num_tokens=step[1]))
            rb = ours.cache.evict(EvictParams(num_tokens=step[1]))
            assert ra.num_tokens_evicted == rb.num_tokens_evicted
        elif kind == "match":
            tokens = FAMILIES[step[1]][: step[2]]
            assert stock.match_len(tokens) == ours.match_len(tokens)

        assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache), f"diverged after {step}"
        for a, b in running:
            assert (a.req.kv.cache_protected_len, a.done) == (b.req.kv.cache_protected_len, b.done)
            row_a = stock.pool.req_to_token[a.req.kv.req_pool_idx, : a.done]
            row_b = ours.pool.req_to_token[b.req.kv.req_pool_idx, : b.done]
            assert row_a.tolist() == row_b.tolist()
    for a, b in running:
        if a.req.kv.kv_allocated_len > 0:
            stock.finish(a), ours.finish(b)
    assert tree_snapshot(ours.cache) == tree_snapshot(stock.cache)
    ours.cache.sanity_check()
    return stock.cache, ours.cache


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tree_core", ["python", "rust"])
@settings(max_examples=int(__import__("os").environ.get("KLLM_HYPO_EXAMPLES", "30")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=scenario)
def test_incremental_cache_matches_stock(tree_core: str, page_size: int, ops: list[tuple]) -> None:
    _run(page_size, ops, tree_core)


@pytest.mark.parametrize("tree_core", ["python", "rust"])
def test_long_chunked_prompt_uses_tail_inserts_and_matches_stock(tree_core: str) -> None:
    """A deterministic scenario: two requests sharing half a prompt, prefilled in interleaved
    chunks (each splits the other's nodes), then decode and finish with output tokens."""
    ops: list[tuple] = [("admit", 0, 300, 0, 1), ("admit", 0, 150, 80, 2)]
    ops += [("chunk", 0, 32), ("chunk", 1, 24)] * 12
    ops += [("decode", 0, 3), ("finish", 0), ("evict", 50), ("decode", 0, 2), ("finish", 0)]
    stock, ours = _run(1, ops, tree_core)
    counters = ours.kllm_counters
    assert counters.tail_inserts >= 18
    assert counters.skipped_tokens > 0
    assert counters.fallbacks == 0
    assert counters.full_by_reason.get("no_state") == 2
