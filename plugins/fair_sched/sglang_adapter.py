"""Layer: SGLang adapter of fair_sched. The only module of the plugin that touches SGLang objects.

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
* `SchedulePolicy.calc_priority` (around): one-chunk requests first, the oldest long request
  right after those that fit beside its minimum share.
* `SchedulePolicy.shortest_prefill_chunk_limit` (around): the long request's chunk cap.
* `Scheduler.get_prefill_adder_class` (around): a `PrefillAdder` subclass that refuses a
  second truncated (partially prefilled) request and admits nothing while the watermark gate
  is closed.
* `Req.update_finish_state` (around): the repetition-loop cut.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.fair_sched.config import FairSchedConfig
from kllm_plugins.plugins.fair_sched.core.quota import FairPolicy, PassPlan, WaitingItem
from kllm_plugins.plugins.fair_sched.core.repetition import RepetitionDetector
from kllm_plugins.plugins.fair_sched.core.watermark import WatermarkGate
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.fair_sched")

PLUGIN = "fair_sched"
LOOP_REASON = "repetition_loop"


class _State:
    """Per-scheduler-process state (one scheduler per process with TP=1 on this platform)."""

    def __init__(self, cfg: FairSchedConfig, chunk_tokens: int, page_size: int) -> None:
        self.cfg = cfg
        self.policy = FairPolicy(cfg.quota_params(chunk_tokens, page_size))
        self.gate = WatermarkGate(cfg.kv_high_watermark, cfg.kv_low_watermark)
        self.long_limit: int | None = None
        self.parked: Any = None
        self.admit = True
        self.chunk_end: dict[str, int] = {}
        self.counters: dict[str, int] = {
            "passes": 0,
            "long_started": 0,
            "long_finished": 0,
            "long_chunks": 0,
            "long_tokens": 0,
            "yields_to_decode": 0,
            "yields_to_short": 0,
            "limited_passes": 0,
            "shorts_beside_long": 0,
            "recomputed_tokens": 0,
            "second_truncation_refused": 0,
            "loops_cut": 0,
            "loop_freed_tokens": 0,
        }
        self.writer = StatsWriter(PLUGIN, cfg.publish_interval_s)
        self._m_yields = metrics.counter("kllm_fair_sched_yields_total", "Passes a long prefill yielded", ("to",))
        self._m_chunks = metrics.counter("kllm_fair_sched_long_chunks_total", "Chunks prefilled for long requests")
        self._m_loops = metrics.counter("kllm_fair_sched_loops_cut_total", "Outputs cut for a repetition loop")
        self._m_paused = metrics.gauge("kllm_fair_sched_admission_paused_bool", "1 while the KV watermark gate is closed")

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = dict(self.counters)
        snap.update(self.gate.state())
        a = self.policy.active
        snap["active_long_rid"] = a.rid if a else None
        snap["active_long_quota"] = a.quota if a else 0
        snap["budget_tokens"] = self.policy.params.budget_tokens
        return snap

    def publish(self, changed: bool) -> None:
        self.writer.update(self.snapshot, changed)


_state: _State | None = None
_loop_detectors: dict[str, RepetitionDetector] = {}


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
    return _state


def _work(req: Any) -> int:
    # Same estimate as SGLang's shortest-prefill-first: uncached prompt (plus output on retraction).
    return max(1, len(req.origin_input_ids) + len(req.output_ids) - int(getattr(req, "num_matched_prefix_tokens", 0) or 0))


def _items(queue: list[Any]) -> list[WaitingItem]:
    return [WaitingItem(r.rid, _work(r), r.time_stats.wait_queue_entry_time) for r in queue]


def _kv_used(scheduler: Any) -> tuple[int, int]:
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
    cr = self.chunked_req
    if pol.active is not None and (cr is None or cr.rid != pol.active.rid):
        # It left without our observing its last chunk (abort or retraction).
        pol.finish_long(pol.active.rid)
    used, total = _kv_used(self)
    was_paused = st.gate.paused
    st.admit = st.gate.update(used, total)
    if st.gate.paused != was_paused:
        st._m_paused.set(1 if st.gate.paused else 0)
        logger.info("fair_sched: KV usage %.3f, admission %s", st.gate.usage, "paused" if st.gate.paused else "resumed")
    if not st.admit and cr is None:
        st.publish(bool(self.waiting_queue))
        return None, running_batch
    decode_running = bool(running_batch is not None and any(not r.finished() for r in running_batch.reqs))
    plan = pol.plan(_items(self.waiting_queue), decode_running) if cr is not None else PassPlan("admit")
    if plan.action == "yield":
        st.counters[f"yields_to_{plan.yield_to}"] += 1
        st._m_yields.labels(to=plan.yield_to).inc()
        if plan.yield_to == "decode":
            st.publish(True)
            return None, running_batch
        self.chunked_req = None
        st.parked = cr
        try:
            result = original(self, *args, **kwargs)
        finally:
            if self.chunked_req is not None:  # cannot happen: the adder refuses truncation while parked
                logger.error("fair_sched: a request was truncated while %s was parked", cr.rid)
            self.chunked_req = cr
            st.parked = None
    else:
        st.long_limit = plan.long_limit
        if plan.long_limit is not None:
            st.counters["limited_passes"] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            st.long_limit = None
    batch = result[0] if isinstance(result, tuple) else None
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
    for req in batch.reqs:
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
    if st is not None and len(waiting_queue) > 1:
        items = _items(waiting_queue)
        order = st.policy.order(items)
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


def _fair_adder(base: type) -> type:
    if base in _adder_classes:
        return _adder_classes[base]
    from sglang.srt.managers.schedule_policy import AddReqResult

    class FairPrefillAdder(base):  # type: ignore[misc, valid-type]
        """Refuses a second partially prefilled request and admission while the gate is closed."""

        def add_one_req(self, req: Any, has_chunked_req: bool, truncation_align_size: Any) -> Any:
            st = _state
            if st is not None and not st.admit:
                return AddReqResult.OTHER
            return super().add_one_req(req, has_chunked_req, truncation_align_size)

        def _select_prefill_admission(self, req: Any, **kwargs: Any) -> Any:
            admission = super()._select_prefill_admission(req, **kwargs)
            st = _state
            if (
                st is not None
                and getattr(admission, "is_chunked", False)
                and (kwargs.get("has_chunked_req") or st.parked is not None)
            ):
                st.counters["second_truncation_refused"] += 1
                return AddReqResult.OTHER
            return admission

    FairPrefillAdder.__qualname__ = f"FairPrefillAdder[{base.__name__}]"
    _adder_classes[base] = FairPrefillAdder
    return FairPrefillAdder


def around_get_prefill_adder_class(original: Callable[..., Any], self: Any) -> Any:
    return _fair_adder(original(self))


# -- Req.update_finish_state -------------------------------------------------------------------------


def _loop_finish_reason(period: int, length: int) -> Any:
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class FinishRepetitionLoop(BaseFinishReason):
        def __init__(self) -> None:
            super().__init__()
            self.period = period
            self.length = length

        def to_json(self) -> dict[str, Any]:
            # "stop" keeps OpenAI-compatible clients working; `reason` says why.
            return {"type": "stop", "matched": None, "reason": LOOP_REASON, "period": period, "loop_tokens": length}

    return FinishRepetitionLoop()


def around_update_finish_state(original: Callable[..., Any], self: Any, new_accepted_len: int = 1) -> Any:
    result = original(self, new_accepted_len)
    cfg = runtime.config_of(PLUGIN)
    if not cfg.loop_min_tokens:
        return result
    rid = self.rid
    if self.finished():
        _loop_detectors.pop(rid, None)
        return result
    if new_accepted_len <= 0:
        return result
    det = _loop_detectors.get(rid)
    if det is None:
        det = _loop_detectors[rid] = RepetitionDetector(cfg.loop_min_tokens, cfg.loop_max_period)
        new = list(self.output_ids)
    else:
        new = list(self.output_ids[-new_accepted_len:])
    found = det.extend(new)
    if found is not None:
        period, length = found
        self.finished_reason = _loop_finish_reason(period, length)
        _loop_detectors.pop(rid, None)
        st = _state
        if st is not None:
            st.counters["loops_cut"] += 1
            st.counters["loop_freed_tokens"] += len(self.origin_input_ids) + len(self.output_ids)
            st._m_loops.inc()
            st.publish(True)
        logger.info("fair_sched: request %s cut: output repeats a %d-token period for %d tokens", rid, period, length)
    return result


def idle_flush() -> None:
    """Write pending stats (called from tests; the scheduler publishes every busy pass)."""
    if _state is not None:
        _state.publish(False)


def reset_for_tests() -> None:
    global _state
    _state = None
    _loop_detectors.clear()
    _adder_classes.clear()
