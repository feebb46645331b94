"""fair_sched adapter against real SGLang 0.5.23 objects on CPU: SchedulePolicy, PrefillAdder,
Req and a UnifiedRadixCache (Python TreeCore), built as in SGLang's own test kit (map §9)."""
from __future__ import annotations

import dataclasses
import os
from array import array
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.sglang

os.environ.setdefault("SGLANG_PLATFORM", "kllm_cpu")


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    pytest.importorskip("sglang")
    import sglang.test.kits.unified_radix_cache.fixtures as fx
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    fx.TREE_CORE_TEST_BACKEND = "python"
    cache, allocator, pool = fx.build_fixture(CacheConfig(kv_size=8192, max_num_reqs=16, max_context_len=8192))
    yield SimpleNamespace(
        cache=cache, allocator=allocator, Req=Req, ScheduleBatch=ScheduleBatch, AddReqResult=AddReqResult,
        PrefillAdder=PrefillAdder, SchedulePolicy=SchedulePolicy, SamplingParams=SamplingParams,
    )


@pytest.fixture()
def adapter(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from kllm_plugins.plugins.fair_sched import sglang_adapter
    from kllm_plugins.plugins.fair_sched.config import FairSchedConfig

    monkeypatch.setenv("KLLM_RUN_DIR", str(tmp_path))
    sglang_adapter.reset_for_tests()
    # Budget sharing (riding off) and FCFS long order here; the riding pass has its own test.
    cfg = FairSchedConfig(decode_every_chunks=2, short_extra_tokens=0, decode_share=0.0, age_weight=8.0)
    sglang_adapter._state = sglang_adapter._State(cfg, 128, 1)
    yield sglang_adapter
    sglang_adapter.reset_for_tests()


_next = [0]


def make_req(env: SimpleNamespace, rid: str, n: int, arrival: float) -> Any:
    _next[0] += 1
    base = 1000 * _next[0]
    req = env.Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", [(base + i) % 4000 + 5 for i in range(n)]),
        sampling_params=env.SamplingParams(temperature=0, max_new_tokens=4),
    )
    req.time_stats.wait_queue_entry_time = arrival
    return req


def new_adder(env: SimpleNamespace, cls: type, chunk: int = 128) -> Any:
    return cls(1, env.cache, env.allocator, env.ScheduleBatch(reqs=[], batch_is_full=False), 0.5, 8192, chunk)


def test_calc_priority_orders_a_real_waiting_queue(env: SimpleNamespace, adapter: Any) -> None:
    policy = env.SchedulePolicy("fcfs", env.cache, False, False, False)
    queue = [make_req(env, "L1", 900, 1.0), make_req(env, "s2", 60, 2.0), make_req(env, "s3", 100, 3.0),
             make_req(env, "s0", 20, 0.5)]
    # The key reads SGLang's own prefill-token clock at arrival (hrrn's): L1 arrived 8000 tokens
    # earlier, so with age_weight 8 it is ahead of s3 (8000 + 800 > 0 + 7200 ... see keys below).
    for r, clock in zip(queue, (0, 7600, 8000, 7990)):
        r.arrival_processed_tokens = clock
    adapter.around_calc_priority(env.SchedulePolicy.calc_priority, policy, queue, None)
    # keys: L1 0 + 8 x 900 = 7200; s2 7600 + 480 = 8080; s3 8000 + 800 = 8800; s0 7990 + 160 = 8150
    assert [r.rid for r in queue] == ["L1", "s2", "s0", "s3"]
    for r in queue:
        r.arrival_processed_tokens = 0  # same arrival clock: smallest work first
    adapter.around_calc_priority(env.SchedulePolicy.calc_priority, policy, queue, None)
    assert [r.rid for r in queue] == ["s0", "s2", "s3", "L1"]


def test_adder_refuses_a_second_partial_request_that_stock_would_truncate(env: SimpleNamespace, adapter: Any) -> None:
    stock = new_adder(env, env.PrefillAdder)
    req = make_req(env, "stock-long", 300, 0.0)
    req.init_next_round_input(env.cache)
    stock.add_one_req(req, has_chunked_req=True, truncation_align_size=None)
    assert stock.new_chunked_req is req  # stock fcfs truncates even though a chunked request exists

    fair_cls = adapter.around_get_prefill_adder_class(lambda self: env.PrefillAdder, None)
    assert issubclass(fair_cls, env.PrefillAdder)
    ours = new_adder(env, fair_cls)
    req2 = make_req(env, "fair-long", 300, 0.0)
    req2.init_next_round_input(env.cache)
    res = ours.add_one_req(req2, has_chunked_req=True, truncation_align_size=None)
    assert res == env.AddReqResult.OTHER and ours.new_chunked_req is None and ours.can_run_list == []
    assert adapter._state.counters["second_truncation_refused"] == 1
    # Without a chunked request the same kind of request is truncated and becomes the partial one.
    req3 = make_req(env, "fair-first", 300, 0.0)
    req3.init_next_round_input(env.cache)
    ours.add_one_req(req3, has_chunked_req=False, truncation_align_size=None)
    assert ours.new_chunked_req is req3 and req3.extend_end - req3.prefix_len == 128


def test_adder_admits_nothing_while_the_watermark_gate_is_closed(env: SimpleNamespace, adapter: Any) -> None:
    fair_cls = adapter._fair_adder(env.PrefillAdder)
    adapter._state.admit = False
    adder = new_adder(env, fair_cls)
    req = make_req(env, "gated", 40, 0.0)
    req.init_next_round_input(env.cache)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == env.AddReqResult.OTHER
    assert adder.can_run_list == []
    adapter._state.admit = True
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == env.AddReqResult.CONTINUE
    assert adder.can_run_list == [req]


def test_chunk_limit_caps_the_continuing_chunk(env: SimpleNamespace, adapter: Any) -> None:
    policy = env.SchedulePolicy("fcfs", env.cache, False, False, False)
    req = make_req(env, "cont", 500, 0.0)
    req.init_next_round_input(env.cache)
    assert adapter.around_shortest_prefill_chunk_limit(env.SchedulePolicy.shortest_prefill_chunk_limit, policy, req, [], 128, 1) is None
    adapter._state.long_limit = 48
    limit = adapter.around_shortest_prefill_chunk_limit(env.SchedulePolicy.shortest_prefill_chunk_limit, policy, req, [], 128, 1)
    assert limit == 48
    adder = new_adder(env, adapter._fair_adder(env.PrefillAdder))
    adder.chunked_req_limit = limit
    assert adder.add_chunked_req(req) is req  # still unfinished after this chunk
    assert req.extend_end - req.prefix_len == 48
    assert adder.rem_chunk_tokens == 128 - 48  # the rest is left to one-chunk requests


def test_chunk_guard_cuts_or_parks_a_continuation_the_free_kv_cannot_hold(env: SimpleNamespace, adapter: Any) -> None:
    """SGLang 0.5.23's single-pool budget hands a continuing chunk a whole chunk once the pass budget
    (free KV minus the decode headroom it reserves) is spent, even when fewer tokens are free: the
    allocation then fails and the server exits (seen on the H200). The guard cuts or parks it."""
    alloc = env.allocator
    held = [alloc.alloc(alloc.available_size() - 100)]  # 100 tokens left free
    try:
        dec = make_req(env, "decoding", 10, 0.0)
        dec.sampling_params.max_new_tokens = 1000  # its reserved headroom exceeds what is free
        running = env.ScheduleBatch(reqs=[dec], batch_is_full=False)

        def adder(cls: type) -> Any:
            return cls(1, env.cache, alloc, running, 0.5, 8192, 128)

        stock = adder(env.PrefillAdder)
        assert stock.memory_budget.remaining_total <= 0
        r1 = make_req(env, "stock-cont", 500, 0.0)
        r1.init_next_round_input(env.cache)
        stock.add_chunked_req(r1)
        assert r1.extend_end - r1.prefix_len == 128 > alloc.available_size()  # its allocation would fail

        fair_cls = adapter._fair_adder(env.PrefillAdder)
        ours = adder(fair_cls)
        r2 = make_req(env, "fair-cont", 500, 0.0)
        r2.init_next_round_input(env.cache)
        assert ours.add_chunked_req(r2) is r2 and r2 in ours.can_run_list
        # 100 free less two pages of slack and 8 decode steps of the one running request
        assert adapter._state.cfg.chunk_guard_decode_steps == 8
        assert r2.extend_end - r2.prefix_len == 90
        assert adapter._state.counters["chunks_cut_for_kv"] == 1

        # A running request whose only token is its prefill's (result pending) needs no decode
        # headroom: the same cut, not 8 more tokens off it.
        pending = make_req(env, "prefill-only", 10, 0.0)
        pending.sampling_params.max_new_tokens = 1
        ours = fair_cls(1, env.cache, alloc, env.ScheduleBatch(reqs=[dec, pending], batch_is_full=False), 0.5, 8192, 128)
        r2b = make_req(env, "fair-cont-2", 500, 0.0)
        r2b.init_next_round_input(env.cache)
        assert ours.add_chunked_req(r2b) is r2b and r2b.extend_end - r2b.prefix_len == 90
        assert adapter._state.counters["chunks_cut_for_kv"] == 2

        held.append(alloc.alloc(alloc.available_size() - 2))  # not one page beyond the slack
        ours = adder(fair_cls)
        r3 = make_req(env, "fair-parked", 500, 0.0)
        r3.init_next_round_input(env.cache)
        assert ours.add_chunked_req(r3) is r3 and ours.can_run_list == []
        short = make_req(env, "short", 8, 1.0)
        short.init_next_round_input(env.cache)
        assert ours.add_one_req(short, has_chunked_req=True, truncation_align_size=None) == env.AddReqResult.OTHER
        assert ours.can_run_list == [] and adapter._state.counters["chunks_parked_for_kv"] == 1

        # nothing decoding (nothing will free KV): SGLang's own answer stands
        idle = fair_cls(1, env.cache, alloc, env.ScheduleBatch(reqs=[], batch_is_full=False), 0.5, 8192, 128)
        r4 = make_req(env, "fair-idle", 500, 0.0)
        r4.init_next_round_input(env.cache)
        idle.memory_budget.total_offset = idle.memory_budget._available_and_evictable()  # budget spent
        idle.add_chunked_req(r4)
        assert r4.extend_end - r4.prefix_len == 128

        # chunk_guard off: stock behaviour
        adapter._state.cfg = dataclasses.replace(adapter._state.cfg, chunk_guard=False)
        ours = adder(fair_cls)
        r5 = make_req(env, "guard-off", 500, 0.0)
        r5.init_next_round_input(env.cache)
        ours.add_chunked_req(r5)
        assert r5.extend_end - r5.prefix_len == 128
    finally:
        for h in held:
            alloc.free(h)


def test_ignore_eos_path_refuses_a_second_truncation(env: SimpleNamespace, adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a radix cache SGLang admits ignore_eos requests through add_one_req_ignore_eos, which
    truncates without _select_prefill_admission; fair_sched refuses the second truncation there too
    (else the parked request is put back over the new partial one, whose KV then leaks)."""
    fair_cls = adapter._fair_adder(env.PrefillAdder)
    monkeypatch.setattr(env.cache, "disable", True, raising=False)
    ours = new_adder(env, fair_cls)
    req = make_req(env, "eos-long", 300, 0.0)
    req.sampling_params.ignore_eos = True
    req.init_next_round_input(env.cache)
    res = ours.add_one_req(req, has_chunked_req=True, truncation_align_size=None)
    assert res == env.AddReqResult.OTHER and ours.new_chunked_req is None and ours.can_run_list == []
    assert adapter._state.counters["second_truncation_refused"] == 1
    ours = new_adder(env, fair_cls)
    ours.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert ours.new_chunked_req is req  # the first partial request is still admitted


class _FakeScheduler:
    """Only the attributes the pass planner reads; `original` stands for SGLang's batch builder."""

    def __init__(self, env: SimpleNamespace, chunked: Any, waiting: list[Any]) -> None:
        self.chunked_req = chunked
        self.waiting_queue = waiting
        self.chunked_prefill_size = 128
        self.page_size = 1
        self.max_total_num_tokens = 8192
        self.token_to_kv_pool_allocator = env.allocator
        self.tree_cache = env.cache


def test_pass_planner_yields_by_detaching_the_chunked_request(env: SimpleNamespace, adapter: Any) -> None:
    st = adapter._state
    long_req = make_req(env, "long", 3000, 0.0)
    long_req.init_next_round_input(env.cache)
    st.policy.start_long("long", 3000)
    st.policy.record_run("long", 128)
    big_short = make_req(env, "big", 120, 1.0)  # cannot share a pass beside the long's 32 tokens
    sched = _FakeScheduler(env, long_req, [big_short])
    seen: list[Any] = []

    def original(self: Any, prefill_delayer_single_pass: Any, running_batch: Any) -> Any:
        seen.append((self.chunked_req, st.parked, st.long_limit))
        return None, running_batch

    running = env.ScheduleBatch(reqs=[], batch_is_full=False)
    adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=running)
    # Quota (128) used and a blocked short waits: SGLang builds this pass without the chunked request.
    assert seen == [(None, long_req, None)]
    assert sched.chunked_req is long_req and st.parked is None
    assert st.counters["yields_to_short"] == 1 and st.policy.active.quota == 192

    # Next pass: the long request runs again; a small short shares the pass through the chunk cap.
    sched.waiting_queue = [make_req(env, "small", 40, 2.0)]
    adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=running)
    assert seen[-1] == (long_req, None, 88)

    # With requests decoding and two prefill passes since the last decode step, the pass goes to decode.
    st.policy.record_run("long", 88)
    st.policy.note_prefill()
    st.policy.note_prefill()
    decoding = make_req(env, "dec", 10, 3.0)
    running_dec = env.ScheduleBatch(reqs=[decoding], batch_is_full=False)
    calls = len(seen)
    out = adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=running_dec)
    assert out == (None, running_dec) and len(seen) == calls
    assert st.counters["yields_to_decode"] == 1

    # busy_decode_reqs: the scheduler's count of unfinished running requests reaches the policy;
    # with that many decoding, a decode step comes after a single chunk.
    st.policy.params = dataclasses.replace(st.policy.params, busy_decode_reqs=3)
    sched.waiting_queue = []
    adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=running_dec)
    assert len(seen) == calls + 1  # one decoding request: the long request runs
    st.policy.note_prefill()
    busy = env.ScheduleBatch(reqs=[make_req(env, f"d{i}", 10, 4.0) for i in range(3)], batch_is_full=False)
    out = adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=busy)
    assert out == (None, busy) and len(seen) == calls + 1
    assert st.counters["yields_to_decode"] == 2

    # Requests whose only token is their prefill's (max_new_tokens 1, result still pending, as
    # under overlap scheduling) never decode: no decode step is planned for them.
    st.policy.note_prefill()
    prefill_only = [make_req(env, f"p{i}", 10, 5.0) for i in range(3)]
    for r in prefill_only:
        r.sampling_params.max_new_tokens = 1
    done_prefill = env.ScheduleBatch(reqs=prefill_only, batch_is_full=False)
    adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=done_prefill)
    assert len(seen) == calls + 2 and st.counters["yields_to_decode"] == 2


def test_riding_pass_keeps_the_long_chunk_whole_and_admits_the_short_beside_it(env: SimpleNamespace, adapter: Any) -> None:
    from kllm_plugins.plugins.fair_sched.config import FairSchedConfig

    # Riding only (the chunk keeps its whole budget: minimum share 1.0); defaults: three budgets of extra tokens.
    adapter._state = st = adapter._State(FairSchedConfig(long_min_share=1.0), 128, 1)
    long_req = make_req(env, "ride-long", 3000, 0.0)
    long_req.init_next_round_input(env.cache)
    st.policy.start_long("ride-long", 3000)
    st.policy.record_run("ride-long", 128)
    short = make_req(env, "ride-short", 100, 1.0)
    sched = _FakeScheduler(env, long_req, [short])
    policy = env.SchedulePolicy("fcfs", env.cache, False, False, False)
    built: dict[str, Any] = {}

    def original(self: Any, prefill_delayer_single_pass: Any, running_batch: Any) -> Any:
        # The steps of SGLang's batch builder that involve the adder, in its order.
        adder = new_adder(env, adapter.around_get_prefill_adder_class(lambda s: env.PrefillAdder, self))
        self.chunked_req.init_next_round_input(env.cache)
        adder.chunked_req_limit = adapter.around_shortest_prefill_chunk_limit(
            env.SchedulePolicy.shortest_prefill_chunk_limit, policy, self.chunked_req, self.waiting_queue,
            adder.rem_chunk_tokens, 1)
        self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for r in self.waiting_queue:
            r.init_next_round_input(env.cache)
            adder.add_one_req(r, has_chunked_req=True, truncation_align_size=None)
        built["adder"] = adder
        return None, running_batch

    running = env.ScheduleBatch(reqs=[], batch_is_full=False)
    adapter.around_get_new_batch_prefill_raw(original, sched, prefill_delayer_single_pass=None, running_batch=running)
    adder = built["adder"]
    # The long request's chunk is the whole budget; the short rides in the extra tokens.
    assert long_req.extend_end - long_req.prefix_len == 128
    assert adder.can_run_list == [long_req, short] and short.extend_end - short.prefix_len == 100
    assert st.counters["ride_passes"] == 1 and st.counters["yields_to_short"] == 0
    assert st.extra_tokens == 0 and st.long_limit is None  # only for that pass
    # Stock fcfs with the same budget would have left the short waiting (no room beside 128).
    stock = new_adder(env, env.PrefillAdder)
    assert stock.rem_chunk_tokens == 128


def test_load_section_reads_the_scheduler_snapshot_for_its_dp_rank(tmp_path: Any, adapter: Any) -> None:
    import json
    import time

    def write(pid: int, dp_rank: int, usage: float, paused: bool, at: float) -> None:
        data = {"dp_rank": dp_rank, "kv_usage": usage, "admission_paused": paused, "waiting_long_reqs": 2,
                "active_long": {"rid": "x", "work_tokens": 900, "computed_tokens": 300, "quota_tokens": 192, "yields": 1},
                "waiting_long_rids": ["a", "b"]}
        (tmp_path / f"fair_sched.{pid}.json").write_text(json.dumps({"pid": pid, "time": at, "data": data}))

    now = time.time()
    write(11, 0, 0.5, False, now - 5)
    write(12, 0, 0.97, True, now - 1)  # newer snapshot of the same rank wins
    write(13, 1, 0.1, False, now)
    sec = adapter.load_section(0, str(tmp_path))
    assert sec["kv_usage"] == 0.97 and sec["admission_paused"] == 1 and sec["waiting_long_reqs"] == 2
    assert sec["active_long_remaining_tokens"] == 600 and sec["active_long_quota_tokens"] == 192
    assert 0.5 <= sec["age_s"] < 30
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sec.values())
    assert adapter.load_section(1, str(tmp_path))["kv_usage"] == 0.1
    assert adapter.load_section(2, str(tmp_path)) is None


def test_snapshot_reports_the_waiting_long_queue_and_active_quota(env: SimpleNamespace, adapter: Any) -> None:
    st = adapter._state
    st.sched = _FakeScheduler(env, None, [make_req(env, "L1", 900, 1.0), make_req(env, "s", 40, 2.0)])
    st.policy.start_long("A", 2000)
    st.policy.record_run("A", 128)
    snap = st.snapshot()
    assert snap["waiting_reqs"] == 2 and snap["waiting_long_reqs"] == 1 and snap["waiting_long_rids"] == ["L1"]
    assert snap["active_long"]["rid"] == "A" and snap["active_long"]["computed_tokens"] == 128
    assert snap["active_long"]["quota_tokens"] == 128 and snap["base_quota_tokens"] == 128


def test_pass_timing_lags_one_pass_only_for_the_overlap_scheduler_on_an_asynchronous_device(adapter: Any) -> None:
    from kllm_plugins.plugins.fair_sched import sglang_adapter

    def sched(overlap: bool, device: str) -> SimpleNamespace:
        return SimpleNamespace(enable_overlap=overlap, device=device)

    assert sglang_adapter.timing_lag(sched(True, "cuda")) == 1
    assert sglang_adapter.timing_lag(sched(False, "cuda")) == 0  # --disable-overlap-schedule
    assert sglang_adapter.timing_lag(sched(True, "cpu")) == 0  # a CPU pass ends inside its launch
