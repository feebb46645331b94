"""Layer: SGLang adapter of fair_sched, rounds SGLang decodes without planning a pass.

SGLang 0.5.23's `--prefill-decode-interval N` makes the scheduler skip the prefill for N rounds
after each prefill batch (`Scheduler._should_defer_prefill`); those rounds never reach
`_get_new_batch_prefill_raw`, where fair_sched plans and times each pass. Unseen, such a round
would leave fair_sched's decode rules thinking no decode step had run since the last prefill
(they would add one of their own) and stretch the next interval between plan calls over two
passes. Here each deferred round that decodes is handed to the core as a decode step.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kllm_plugins.plugins.fair_sched import sglang_adapter


def around_should_defer_prefill(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    deferred = original(self, *args, **kwargs)
    st = sglang_adapter.state()
    if not deferred or st is None or st.sched is not self:
        return deferred
    running = args[0] if args else kwargs.get("running_batch")
    if running is not None and not running.is_empty():
        st.policy.note_unplanned_decode(time.monotonic(), bool(self.waiting_queue))
        st.counters["interval_decode_rounds"] += 1
    return deferred
