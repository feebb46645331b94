"""Layer: SGLang adapter of fair_sched, several partial prefills (`max_partial_prefills` > 1).

SGLang 0.5.23 holds one partially prefilled request, `Scheduler.chunked_req`. To let an
earlier-key request larger than a pass start while a long prompt is half prefilled, the core
suspends the partial request (`FairPolicy.plan` -> yield to "partial") and this module keeps it
aside: `chunked_req` is cleared for that pass, so SGLang may truncate the newcomer, which becomes
the next `chunked_req`. The suspended request keeps its `req_to_token` row and its KV, which
SGLang checkpointed into the radix tree after its last chunk (`stash_chunked_request`:
`prefix_len == extend_end`); its in-flight chunk, if any, is still counted on the request
itself (`inflight_middle_chunks`) and settled when its result is processed. When no request is
partially prefilled any more, the suspended one with the smallest key is put back as
`chunked_req` and continues from `prefix_len`.

An abort of a suspended request (`Scheduler.abort_request` finds it in no queue) is noted here;
at the start of the next pass the request is put in `chunked_req` for a moment and released by
SGLang's own chunked abort (`process_pending_chunked_abort`: KV, request slot, abort output);
the scheduler's partial request, if any, is then put back.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger("kllm.fair_sched")


def suspend(st: Any, scheduler: Any, req: Any) -> None:
    """Set the partial request aside for this pass and the ones after (the core already moved its state)."""
    st.suspended_reqs[req.rid] = req
    scheduler.chunked_req = None


def resume(st: Any, scheduler: Any) -> None:
    """No request is partially prefilled: put the suspended one with the smallest key back as
    `chunked_req`. Requests that finished meanwhile are dropped."""
    pol = st.policy
    while scheduler.chunked_req is None and st.suspended_reqs:
        state = pol.resume()
        if state is None:  # the core lost track of them (cannot happen): give every one back in turn
            rid = next(iter(st.suspended_reqs))
            logger.error("fair_sched: suspended request %s has no policy state; resuming it", rid)
        else:
            rid = state.rid
        req = st.suspended_reqs.pop(rid, None)
        if req is None or req.finished():
            pol.finish_long(rid)
            continue
        scheduler.chunked_req = req
        st.counters["partials_resumed"] += 1


def release_aborted(st: Any, scheduler: Any) -> None:
    """Release the suspended requests an abort named, through SGLang's chunked abort."""
    current, other = scheduler.chunked_req, scheduler._pending_chunked_abort_req
    for rid in [r for r in st.abort_suspended if r in st.suspended_reqs]:
        st.policy.finish_long(rid)
        req = st.suspended_reqs.pop(rid)
        scheduler.chunked_req = scheduler._pending_chunked_abort_req = req
        scheduler.process_pending_chunked_abort()  # it clears both
        st.counters["partials_aborted"] += 1
    st.abort_suspended.clear()
    scheduler.chunked_req, scheduler._pending_chunked_abort_req = current, other


def around_abort_request(original: Callable[..., Any], self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(self, recv_req, *args, **kwargs)
    from kllm_plugins.plugins.fair_sched.sglang_adapter import state

    st = state()
    if st is not None and st.suspended_reqs:
        every = bool(getattr(recv_req, "abort_all", False))
        rid = str(getattr(recv_req, "rid", "") or "")
        for r in st.suspended_reqs:
            if every or (rid and r.startswith(rid)):
                st.abort_suspended.add(r)
    return result
