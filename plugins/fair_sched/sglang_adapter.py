"""Layer: SGLang adapter of fair_sched (with `sglang_partials`, `sglang_loops` and `sglang_interval`,
the only modules of the plugin that touch SGLang objects).

It translates SGLang's scheduler state (waiting queue, `Scheduler.chunked_req`, running batch,
KV allocator) into the core's plain types each pass and applies the core's decisions:

* `Scheduler._get_new_batch_prefill_raw` (around): sync the active long request, update the
  KV watermark gate, plan the pass. A yield to decode returns no prefill batch (the scheduler
  then runs a decode step). A yield to one-chunk requests detaches `chunked_req` for this one
  pass, so SGLang builds the batch exactly as if no request were chunked: no
  `inflight_middle_chunks` increment for a request that is not in the batch (the pitfall of
  parking inside `add_chunked_req`), `contains_last_prefill_chunk` and `init_new(chunked_req=)`
  stay right. The parked request keeps its `req_to_token` row and KV (already checkpointed:
  `prefix_len == extend_end`), and resumes from `prefix_len` on the next pass.
* `SchedulePolicy.calc_priority` (around): the core's order, by key = SGLang's prefill-token
  clock at arrival (`Req.arrival_processed_tokens`, kept for hrrn under every policy) +
  age_weight x uncached prompt.
* `SchedulePolicy.shortest_prefill_chunk_limit` (around): the long request's chunk cap.
* `Scheduler.get_prefill_adder_class` (around): a `PrefillAdder` subclass that refuses a
  second truncated (partially prefilled) request, admits nothing while the watermark gate
  is closed, and (chunk_guard) cuts or parks a continuing chunk the free KV cannot hold, where
  SGLang's single-pool budget would hand it a whole chunk and its allocation would end the server.
* `Req.update_finish_state`, `Scheduler.update_running_batch` (around): the repetition-loop
  reclaim, in `sglang_loops`.
* `LoadSnapshot.to_dict` (around, in the HTTP process): adds the `kllm_fair_sched` section,
  read from the scheduler's published snapshot, to `/v1/loads`.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
from typing import Any, Callable

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.fair_sched.config import FairSchedConfig
from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, WaitingItem
from kllm_plugins.plugins.fair_sched.core.watermark import WatermarkGate, continuation_tokens
from kllm_plugins.plugins.fair_sched import sglang_partials as partials
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.fair_sched")

PLUGIN = "fair_sched"
LOADS_KEY = "kllm_fair_sched"
"""Section name in /v1/loads (its Prometheus gauges are sglang_kllm_fair_sched_<field>)."""


class _State:
    """Per-scheduler-process state (one scheduler per process with TP=1 on this platform)."""

    def __init__(self, cfg: FairSchedConfig, chunk_tokens: int, page_size: int) -> None:
        self.cfg = cfg
        self.policy = FairPolicy(cfg.quota_params(chunk_tokens, page_size))
        self.gate = WatermarkGate(cfg.kv_high_watermark, cfg.kv_low_watermark)
        self.long_limit: int | None = None
        self.extra_tokens = 0
        """Tokens the current pass's adder adds to its chunk budget for riding one-chunk requests."""
        self.pass_budget: int | None = None
        self.parked: Any = None
        self.suspended_reqs: dict[str, Any] = {}
        """rid -> partially prefilled request set aside for an earlier-key one (sglang_partials)."""
        self.abort_suspended: set[str] = set()
        self.suspending = False
        """True during the pass planned for the request a partial one was suspended for."""
        self.admit = True
        self.chunk_end: dict[str, int] = {}
        self.counters: dict[str, int] = {
            "passes": 0,
            "long_started": 0,
            "long_finished": 0,
            "long_chunks": 0,
            "long_tokens": 0,
            "yields_to_decode": 0,
            "decode_run_max": 0,
            "yields_to_short": 0,
            "yields_to_partial": 0,
            "partials_resumed": 0,
            "partials_aborted": 0,
            "limited_passes": 0,
            "ride_passes": 0,
            "shorts_beside_long": 0,
            "recomputed_tokens": 0,
            "second_truncation_refused": 0,
            "chunks_cut_for_kv": 0,
            "chunks_parked_for_kv": 0,
            "loops_cut": 0,
            "loop_freed_tokens": 0,
            "loops_retracted": 0,
            "loop_retract_freed_tokens": 0,
            "interval_decode_rounds": 0,
        }
        self.sched: Any = None
        self.writer = StatsWriter(PLUGIN, cfg.publish_interval_s)
        self._m_yields = metrics.counter("kllm_fair_sched_yields_total", "Passes a long prefill yielded", ("to",))
        self._m_chunks = metrics.counter("kllm_fair_sched_long_chunks_total", "Chunks prefilled for long requests")
        self._m_loops = metrics.counter("kllm_fair_sched_loops_cut_total", "Outputs cut for a repetition loop")
        self._m_retracts = metrics.counter("kllm_fair_sched_loops_retracted_total", "Outputs retracted for a repetition loop")
        self._m_paused = metrics.gauge("kllm_fair_sched_admission_paused_bool", "1 while the KV watermark gate is closed")

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = dict(self.counters)
        snap.update(self.gate.state())
        p = self.policy.params
        snap.update(budget_tokens=p.budget_tokens, base_quota_tokens=p.base_quota_tokens,
                    quota_growth=p.quota_growth, max_quota_tokens=p.max_quota_tokens)
        a = self.policy.active
        snap["active_long"] = None if a is None else {
            "rid": a.rid, "work_tokens": a.work_tokens, "computed_tokens": a.computed_tokens,
            "quota_tokens": a.quota, "turn_used_tokens": a.turn_used, "yields": a.yields,
        }
        waiting = list(getattr(self.sched, "waiting_queue", None) or [])
        longs = [r.rid for r in waiting if _work(r) > p.budget_tokens]
        snap["waiting_reqs"] = len(waiting)
        snap["waiting_long_reqs"] = len(longs)
        snap["waiting_long_rids"] = longs[:16]
        snap["dp_rank"] = int(getattr(self.sched, "dp_rank", 0) or 0)
        snap["suspended_partials"] = len(self.suspended_reqs)
        snap["timing_lag"] = self.policy.timing_lag
        cost = self.policy.decode_cost_s
        snap["decode_step_ms"] = None if cost is None else round(1e3 * cost, 3)
        # passes' time while prompts waited (counters: a run's share is the difference of two reads)
        snap["waiting_prefill_s"] = round(self.policy.waiting_s["prefill"], 6)
        snap["waiting_decode_s"] = round(self.policy.waiting_s["decode"], 6)
        return snap

    def publish(self, changed: bool) -> None:
        self.writer.update(self.snapshot, changed)


_state: _State | None = None


def state() -> _State | None:
    return _state


def _ensure_state(scheduler: Any) -> _State | None:
    global _state
    if _state is None:
        chunk = getattr(scheduler, "chunked_prefill_size", None)
        if chunk is None or chunk <= 0:
            logger.warning("fair_sched: chunked prefill is disabled; the fair policy is off")
            return None
        _state = _State(runtime.config_of(PLUGIN), int(chunk), int(getattr(scheduler, "page_size", 1) or 1))
        logger.info("fair_sched: policy %s", _state.policy.params)
    if _state.sched is None:
        _state.sched = scheduler
        _state.policy.timing_lag = timing_lag(scheduler)
        logger.info("fair_sched: pass timing lag %d", _state.policy.timing_lag)
        if _state.cfg.mixed_decode and not getattr(scheduler, "is_mixed_chunk", True) and _mixable(scheduler):
            # Stall-free prefill: SGLang's mixed chunk adds one decode token per running request
            # to each prefill pass (and takes them from that pass's chunk budget).
            scheduler.is_mixed_chunk = True
            logger.info("fair_sched: mixed decode on (running requests decode inside prefill passes)")
    return _state


def timing_lag(scheduler: Any) -> int:
    """1 where SGLang's overlap scheduler runs on an asynchronous device: it launches pass i, then
    waits for pass i-1, so the time between two plan calls is pass i-1's (FairPolicy.timing_lag).
    On the CPU a pass runs inside the launch, so that time is pass i's."""
    overlap = bool(getattr(scheduler, "enable_overlap", False))
    return 1 if overlap and str(getattr(scheduler, "device", "cpu")) != "cpu" else 0


def _mixable(scheduler: Any) -> bool:
    """SGLang turns mixed chunk off with speculative decoding, diffusion LMs and HiSparse; so do we."""
    spec = getattr(scheduler, "spec_algorithm", None)
    return (spec is None or spec.is_none()) and getattr(scheduler, "dllm_config", None) is None \
        and not getattr(scheduler, "enable_hisparse", False)


def _work(req: Any) -> int:
    # Same estimate as SGLang's shortest-prefill-first: uncached prompt (plus output on retraction).
    return max(1, len(req.origin_input_ids) + len(req.output_ids) - int(getattr(req, "num_matched_prefix_tokens", 0) or 0))


def _items(queue: list[Any]) -> list[WaitingItem]:
    return [WaitingItem(r.rid, _work(r), r.time_stats.wait_queue_entry_time, int(getattr(r, "arrival_processed_tokens", 0) or 0))
            for r in queue]


def kv_used(scheduler: Any) -> tuple[int, int]:
    total = int(scheduler.max_total_num_tokens)
    free = int(scheduler.token_to_kv_pool_allocator.available_size()) + int(scheduler.tree_cache.evictable_size())
    return max(total - free, 0), total


# -- Scheduler._get_new_batch_prefill_raw --------------------------------------------------------


def around_get_new_batch_prefill_raw(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    st = _ensure_state(self)
    if st is None:
        return original(self, *args, **kwargs)
    running_batch = kwargs["running_batch"] if "running_batch" in kwargs else args[1]
    st.counters["passes"] += 1
    pol = st.policy
    if st.abort_suspended:
        partials.release_aborted(st, self)
    cr = self.chunked_req
    if pol.active is not None and (cr is None or cr.rid != pol.active.rid):
        # It left without our observing its last chunk (abort or retraction).
        pol.finish_long(pol.active.rid)
    if cr is None and st.suspended_reqs:
        partials.resume(st, self)
        cr = self.chunked_req
    used, total = kv_used(self)
    was_paused = st.gate.paused
    st.admit = st.gate.update(used, total)
    if st.gate.paused != was_paused:
        st._m_paused.set(1 if st.gate.paused else 0)
        logger.info("fair_sched: KV usage %.3f, admission %s", st.gate.usage, "paused" if st.gate.paused else "resumed")
    if not st.admit and cr is None:
        st.publish(bool(self.waiting_queue))
        return None, running_batch
    running_reqs = decoding_rows(running_batch)
    decode_running = running_reqs > 0
    mixing = bool(getattr(self, "is_mixed_chunk", False))
    # Decode rows riding along a mixed pass take one budget token each (PrefillAdder does the same).
    budget = int(self.chunked_prefill_size) - len(running_batch.reqs) if mixing and running_batch is not None else None
    # While the gate is closed nothing new is admitted, so there is nobody to yield to or reserve for.
    waiting = _items(self.waiting_queue) if st.admit else []
    now = time.monotonic()
    # A suspended request keeps its KV: none is set aside for a newcomer whose whole prompt would
    # take usage past the low watermark (nor at all once usage is there).
    suspend_room = int(st.cfg.kv_low_watermark * total) - used
    plan = pol.plan(waiting, decode_running, budget, now=now, running_reqs=running_reqs, suspend_room=suspend_room)
    st.pass_budget = budget
    if plan.action == "yield":
        st.counters[f"yields_to_{plan.yield_to}"] += 1
        st._m_yields.labels(to=plan.yield_to).inc()
        if plan.yield_to == "decode":
            # decode steps in a row (several with decode_time_share)
            st.counters["decode_run_max"] = max(st.counters["decode_run_max"], pol.decode_run)
            st.pass_budget = None
            st.publish(True)
            return None, running_batch  # plan() noted this decode step
        if plan.yield_to == "partial":
            partials.suspend(st, self, cr)
            st.pass_budget = None
            st.extra_tokens = plan.extra_tokens
            st.suspending = True
            try:
                result = original(self, *args, **kwargs)  # may truncate the newcomer: the next chunked_req
            finally:
                st.extra_tokens = 0
                st.suspending = False
            return _after_pass(st, self, pol, result, decode_running, now, plan)
        self.chunked_req = None
        st.parked = cr
        st.pass_budget = None
        if mixing:
            # The pass goes to blocked earlier-key requests whole: no decode rows in it this time.
            self.is_mixed_chunk = False
        st.extra_tokens = plan.extra_tokens  # a whole pass for them: budget + the riders' extra
        try:
            result = original(self, *args, **kwargs)
        finally:
            st.extra_tokens = 0
            if self.chunked_req is not None:  # cannot happen: the adder refuses truncation while parked
                logger.error("fair_sched: a request was truncated while %s was parked", cr.rid)
            self.chunked_req = cr
            self.is_mixed_chunk = mixing
            st.parked = None
    else:
        st.long_limit = plan.long_limit
        st.extra_tokens = plan.extra_tokens
        if plan.extra_tokens:
            st.counters["ride_passes"] += 1
        elif plan.long_limit is not None:
            st.counters["limited_passes"] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            st.long_limit = None
            st.extra_tokens = 0
    return _after_pass(st, self, pol, result, decode_running, now, plan)


def decoding_rows(batch: Any) -> int:
    """How many requests of the running batch still need a decode step (the pass planner's decode
    spacing, the chunk guard's KV reserve). One whose whole output is its prefill's token
    (max_new_tokens 1: scoring calls, the prefill side of a disaggregated pair) never does; it can
    sit unfinished in the running batch while that prefill's result is pending (overlap
    scheduling), with no output token yet. A pending decode token is not counted: that
    over-counts a request by its last step at most."""
    if batch is None:
        return 0
    n = 0
    for r in batch.reqs:
        limit = getattr(r.sampling_params, "max_new_tokens", None)
        n += not r.finished() and (limit is None or limit > max(len(r.output_ids), 1))
    return n


def _after_pass(st: _State, self: Any, pol: FairPolicy, result: Any, decode_running: bool, now: float, plan: Any) -> Any:
    st.pass_budget = None
    batch = result[0] if isinstance(result, tuple) else None
    if batch is None and decode_running:
        pol.note_decode(now)  # no prefill this pass: the scheduler decodes the running requests
    elif batch is not None:
        pol.note_prefill()
    try:
        _observe(st, self, batch)
    except Exception:  # noqa: BLE001 - bookkeeping must never take the scheduler down
        logger.exception("fair_sched: bookkeeping failed; resetting the active long request")
        st.policy.active = None
    st.publish(batch is not None or plan.action != "admit")
    return result


def _observe(st: _State, scheduler: Any, batch: Any) -> None:
    if batch is None:
        return
    pol = st.policy
    cr = scheduler.chunked_req
    active_rid = pol.active.rid if pol.active is not None else None
    decoding = {id(r) for r in (getattr(batch, "decoding_reqs", None) or [])}
    for req in batch.reqs:
        if id(req) in decoding:
            continue
        extend = int(req.extend_end) - int(req.prefix_len)
        if extend <= 0:
            continue
        rid = req.rid
        if rid in st.chunk_end:
            # A resumed chunk must start where the last one ended (KV held, nothing recomputed).
            st.counters["recomputed_tokens"] += max(st.chunk_end[rid] - int(req.prefix_len), 0)
        if rid == active_rid:
            pol.record_run(rid, extend)
            st.counters["long_chunks"] += 1
            st.counters["long_tokens"] += extend
            st._m_chunks.inc()
            if cr is None or cr.rid != rid:
                pol.finish_long(rid)
                st.counters["long_finished"] += 1
                st.chunk_end.pop(rid, None)
            else:
                st.chunk_end[rid] = int(req.extend_end)
        elif cr is not None and cr.rid == rid:
            pol.start_long(rid, len(req.full_untruncated_fill_ids) - int(req.prefix_len))
            pol.record_run(rid, extend)
            st.counters["long_started"] += 1
            st.counters["long_chunks"] += 1
            st.counters["long_tokens"] += extend
            st._m_chunks.inc()
            st.chunk_end[rid] = int(req.extend_end)
        elif pol.active is not None or st.parked is not None:
            st.counters["shorts_beside_long"] += 1


# -- SchedulePolicy ------------------------------------------------------------------------------


def around_calc_priority(original: Callable[..., Any], self: Any, waiting_queue: list[Any], *args: Any, **kwargs: Any) -> Any:
    result = original(self, waiting_queue, *args, **kwargs)
    st = _state
    if st is not None and waiting_queue:
        # Also for a single request: the policy keeps the keys it computed (for start_long).
        items = _items(waiting_queue)
        order = st.policy.order(items, st.pass_budget)
        waiting_queue[:] = [waiting_queue[i] for i in order]
    return result


def around_shortest_prefill_chunk_limit(
    original: Callable[..., Any], self: Any, chunked_req: Any, waiting_queue: Any, budget: int, page_size: int
) -> Any:
    st = _state
    if st is None or st.long_limit is None:
        return original(self, chunked_req, waiting_queue, budget, page_size)
    limit = min(st.long_limit, budget) // page_size * page_size if budget >= page_size else st.long_limit
    return max(limit, page_size)


# -- PrefillAdder ----------------------------------------------------------------------------------

_adder_classes: dict[type, type] = {}


def _refuse_second_truncation(has_chunked_req: bool) -> bool:
    """A request would be truncated (become partially prefilled) while another is: the scheduler's
    chunked request, or the one parked for a yield. Counted; the adder then refuses it."""
    st = _state
    # With requests suspended, a new partial prefill starts only on the pass planned for it.
    if st is None or not (has_chunked_req or st.parked is not None or (st.suspended_reqs and not st.suspending)):
        return False
    st.counters["second_truncation_refused"] += 1
    return True


def _fair_adder(base: type) -> type:
    if base in _adder_classes:
        return _adder_classes[base]
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    class FairPrefillAdder(base):  # type: ignore[misc, valid-type]
        """Refuses a second partially prefilled request and admission while the gate is closed;
        on a riding pass its chunk budget has room for the one-chunk requests beside the long chunk."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._fair_kv_parked = False  # chunk_guard held the continuing chunk out: admit nothing
            self._fair_has_chunked = False  # the scheduler's chunked request, as add_one_req was told
            st = _state
            if st is not None and st.extra_tokens and self.rem_chunk_tokens is not None:
                self.rem_chunk_tokens += st.extra_tokens

        def add_chunked_req(self, req: Any) -> Any:
            """chunk_guard: on SGLang's single-pool budget, a continuing chunk that the free KV
            cannot hold is cut to what fits, or sits out the pass (nothing else is admitted in it,
            so the batch is empty and no middle chunk is counted) while requests decode."""
            st = _state
            budget = self.memory_budget
            if (st is None or not st.cfg.chunk_guard or type(budget) is not PrefillBudget
                    or self.dllm_config is not None or not self.rem_chunk_tokens):
                return super().add_chunked_req(req)
            left = budget.remaining_total
            if left > 0:  # budget left: SGLang's own min(chunk, budget) fits the free KV
                return super().add_chunked_req(req)
            n = continuation_tokens(self.rem_chunk_tokens, left, budget._available_and_evictable(), self.page_size,
                                    decode_reserve=decoding_rows(self.running_batch) * st.cfg.chunk_guard_decode_steps)
            if n is None:
                if self.running_batch is None or self.running_batch.is_empty():
                    return super().add_chunked_req(req)  # nothing will free KV: SGLang's own answer
                st.counters["chunks_parked_for_kv"] += 1
                self._fair_kv_parked = True
                return req
            if n < self.rem_chunk_tokens:
                st.counters["chunks_cut_for_kv"] += 1
                self.chunked_req_limit = n if self.chunked_req_limit is None else min(self.chunked_req_limit, n)
            return super().add_chunked_req(req)

        def add_one_req(self, req: Any, has_chunked_req: bool, truncation_align_size: Any) -> Any:
            st = _state
            if st is not None and (not st.admit or self._fair_kv_parked):
                return AddReqResult.OTHER
            self._fair_has_chunked = has_chunked_req
            return super().add_one_req(req, has_chunked_req, truncation_align_size)

        def add_one_req_ignore_eos(self, req: Any) -> Any:
            """SGLang's path for ignore_eos requests without a radix cache truncates without
            `_select_prefill_admission`: the same refusal of a second truncation as there."""
            truncates = (self.rem_chunk_tokens is not None
                         and len(req.full_untruncated_fill_ids) - req.prefix_len > self.rem_chunk_tokens)
            if truncates and _refuse_second_truncation(self._fair_has_chunked):
                return AddReqResult.OTHER
            return super().add_one_req_ignore_eos(req)

        def _select_prefill_admission(self, req: Any, **kwargs: Any) -> Any:
            admission = super()._select_prefill_admission(req, **kwargs)
            if getattr(admission, "is_chunked", False) and _refuse_second_truncation(bool(kwargs.get("has_chunked_req"))):
                return AddReqResult.OTHER
            return admission

    FairPrefillAdder.__qualname__ = f"FairPrefillAdder[{base.__name__}]"
    _adder_classes[base] = FairPrefillAdder
    return FairPrefillAdder


def around_get_prefill_adder_class(original: Callable[..., Any], self: Any) -> Any:
    return _fair_adder(original(self))


# -- LoadSnapshot.to_dict (/v1/loads, HTTP process) -----------------------------------------------------

_LOAD_FIELDS = (
    "kv_usage", "kv_high_watermark", "kv_low_watermark", "admission_paused", "watermark_pauses",
    "watermark_resumes", "waiting_reqs", "waiting_long_reqs", "yields_to_short", "yields_to_decode",
    "long_started", "long_finished", "loops_cut", "loops_retracted", "budget_tokens", "base_quota_tokens",
    "quota_growth", "max_quota_tokens",
)


def load_section(dp_rank: int, run_dir: str | None = None) -> dict[str, float | int] | None:
    """The router's view of one scheduler: numbers only (booleans as 0/1) so that the section is
    valid in both /v1/loads formats; `age_s` says how old the scheduler's snapshot is."""
    best: tuple[float, dict[str, Any]] | None = None
    for path in glob.glob(os.path.join(run_dir or runtime.run_dir(), f"{PLUGIN}.*.json")):
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        data = record.get("data") or {}
        if int(data.get("dp_rank", 0)) == dp_rank and (best is None or record.get("time", 0) > best[0]):
            best = (float(record.get("time", 0)), data)
    if best is None:
        return None
    t, data = best
    out: dict[str, float | int] = {k: int(v) if isinstance(v, bool) else v
                                   for k in _LOAD_FIELDS if isinstance(v := data.get(k), (int, float))}
    a = data.get("active_long") or {}
    out["active_long"] = 1 if a else 0
    out["active_long_remaining_tokens"] = max(int(a.get("work_tokens", 0)) - int(a.get("computed_tokens", 0)), 0)
    out["active_long_quota_tokens"] = int(a.get("quota_tokens", 0))
    out["active_long_yields"] = int(a.get("yields", 0))
    out["age_s"] = round(max(time.time() - t, 0.0), 3)
    return out


def around_load_snapshot_to_dict(original: Callable[..., Any], self: Any, include: Any = None) -> Any:
    result = original(self, include)
    if include is not None and "all" not in include:
        return result  # a filtered view: only the sections asked for
    try:
        section = load_section(int(result.get("dp_rank", 0)))
    except Exception:  # noqa: BLE001 - never break SGLang's load endpoint
        logger.exception("fair_sched: could not read the scheduler snapshot for /v1/loads")
        section = None
    if section is not None:
        result[LOADS_KEY] = section
    return result


def idle_flush() -> None:
    """Write pending stats (called from tests; the scheduler publishes every busy pass)."""
    if _state is not None:
        _state.publish(False)


def reset_for_tests() -> None:
    global _state
    _state = None
    _adder_classes.clear()
