"""Layer: SGLang adapter of fair_sched, the repetition-loop reclaim.

* `Req.update_finish_state` (around): the repetition-loop detector; `loop_action` `finish` ends
  the request with finish reason `repetition_loop`, `retract` marks it for:
* `Scheduler.update_running_batch` (around): before the decode step, marked requests release
  their KV (as SGLang's own retraction does) and go back to the waiting queue.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from kllm_plugins import runtime
from kllm_plugins.plugins.fair_sched import sglang_adapter
from kllm_plugins.plugins.fair_sched.core.repetition import RepetitionDetector

logger = logging.getLogger("kllm.fair_sched")

LOOP_REASON = "repetition_loop"
_loop_detectors: dict[str, RepetitionDetector] = {}
_retract_pending: dict[str, tuple[int, int]] = {}
"""rid -> (period, loop length): looping requests to retract before the next decode step."""
_loop_retracts: dict[str, int] = {}
"""rid -> loop retractions so far."""


# -- Req.update_finish_state -------------------------------------------------------------------------


def _loop_finish_reason(period: int, length: int, retracts: int) -> Any:
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class FinishRepetitionLoop(BaseFinishReason):
        def __init__(self) -> None:
            super().__init__()
            self.period = period
            self.length = length

        def to_json(self) -> dict[str, Any]:
            # "stop" keeps OpenAI-compatible clients working; `reason` says why.
            return {"type": "stop", "matched": None, "reason": LOOP_REASON, "period": period,
                    "loop_tokens": length, "retracts": retracts}

    return FinishRepetitionLoop()


def _forget_loop(rid: str) -> None:
    _loop_detectors.pop(rid, None)
    _retract_pending.pop(rid, None)
    _loop_retracts.pop(rid, None)


def around_update_finish_state(original: Callable[..., Any], self: Any, new_accepted_len: int = 1) -> Any:
    result = original(self, new_accepted_len)
    cfg = runtime.config_of(sglang_adapter.PLUGIN)
    if not cfg.loop_min_tokens:
        return result
    rid = self.rid
    if self.finished():
        _forget_loop(rid)
        return result
    if new_accepted_len <= 0 or rid in _retract_pending:
        return result
    det = _loop_detectors.get(rid)
    if det is None:
        det = _loop_detectors[rid] = RepetitionDetector(cfg.loop_min_tokens, cfg.loop_max_period)
        new = list(self.output_ids)
    else:
        new = list(self.output_ids[-new_accepted_len:])
    found = det.extend(new)
    if found is None:
        return result
    period, length = found
    retracts = _loop_retracts.get(rid, 0)
    st = sglang_adapter.state()
    if cfg.loop_action == "retract" and retracts < cfg.loop_max_retracts:
        # Marked only: the scheduler releases it before the next decode step (update_running_batch).
        _retract_pending[rid] = (period, length)
        logger.info("fair_sched: request %s marked for retraction: output repeats a %d-token period for %d tokens",
                    rid, period, length)
        return result
    self.finished_reason = _loop_finish_reason(period, length, retracts)
    _forget_loop(rid)
    if st is not None:
        st.counters["loops_cut"] += 1
        st.counters["loop_freed_tokens"] += len(self.origin_input_ids) + len(self.output_ids)
        st._m_loops.inc()
        st.publish(True)
    logger.info("fair_sched: request %s cut: output repeats a %d-token period for %d tokens (after %d retraction(s))",
                rid, period, length, retracts)
    return result


# -- Scheduler.update_running_batch (loop_action=retract) ---------------------------------------------


def around_update_running_batch(original: Callable[..., Any], self: Any, batch: Any) -> Any:
    if _retract_pending and batch is not None and batch.reqs:
        try:
            _retract_loops(self, batch)
        except Exception:  # noqa: BLE001 - a failed retraction leaves the request decoding
            logger.exception("fair_sched: loop retraction failed; the requests keep decoding")
            _retract_pending.clear()
    return original(self, batch)


def _retract_loops(scheduler: Any, batch: Any) -> None:
    """Release the KV of marked requests and requeue them, as SGLang's `retract_decode` does for
    memory pressure (`release_req`: free without inserting into the tree, `reset_for_retract`).
    The request keeps its output (what the client already received); on resume it is prefilled
    again from prompt + output at the back of the queue, and its detector starts counting afresh,
    so a second loop is judged on `loop_min_tokens` new tokens. After `loop_max_retracts`
    retractions the next loop finishes it: at most (loop_max_retracts + 1) loops per request."""
    idx = [i for i, r in enumerate(batch.reqs) if r.rid in _retract_pending and not r.finished()
           and getattr(r, "to_finish", None) is None]
    if not idx:
        return
    drop = set(idx)
    keep = [i for i in range(len(batch.reqs)) if i not in drop]
    reqs = [batch.reqs[i] for i in idx]
    used_before, _ = sglang_adapter.kv_used(scheduler)
    for i in idx:
        batch.release_req(i, len(keep), offload_kv=False)
    batch.filter_batch(keep_indices=keep)
    batch.batch_is_full = False
    freed = max(used_before - sglang_adapter.kv_used(scheduler)[0], 0)
    st = sglang_adapter.state()
    for req in reqs:
        rid = req.rid
        _retract_pending.pop(rid, None)
        _loop_retracts[rid] = _loop_retracts.get(rid, 0) + 1
        det = _loop_detectors.get(rid)
        if det is not None:
            det.restart()
        scheduler._add_request_to_queue(req, is_retracted=True)
        logger.info("fair_sched: request %s retracted for a repetition loop (%d of %d) and requeued",
                    rid, _loop_retracts[rid], runtime.config_of(sglang_adapter.PLUGIN).loop_max_retracts)
    if st is not None:
        st.counters["loops_retracted"] += len(reqs)
        st.counters["loop_retract_freed_tokens"] += freed
        st._m_retracts.inc(len(reqs))
        st.publish(True)
