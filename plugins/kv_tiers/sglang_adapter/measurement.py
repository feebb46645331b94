"""Layer: SGLang adapter of the kv_tiers plugin. What fetch or recompute learns from: timings of HiCache and the scheduler.

- the delay an L3 prefetch causes the request that waits for it (`check_prefetch_progress`);
- L2->L1 loads, and HiCache's load-back threshold set from the L2 break-even (`init_load_back`);
- the prefill speed of extend batches (`Scheduler.run_batch`).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kllm_plugins.plugins.kv_tiers.core.prefetch_plan import load_back_threshold
from kllm_plugins.plugins.kv_tiers.sglang_adapter import state
from kllm_plugins.plugins.kv_tiers.sglang_adapter.admission import loaded_tokens


def after_check_prefetch_progress(result: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler asks whether a request's L3 prefetch is over before running it: False = the
    request waits for it (from the first such answer), True = over; record the delay it caused."""
    t = state.current()
    if t is None or not t.prefetch_started:
        return None
    if result is False:
        t.prefetch_blocking(request)
    elif result is True:
        loaded = loaded_tokens(self, request)
        wait = t.prefetch_done(request, loaded)
        # only fetches that loaded something price a fetch: a miss that got past the probe (a page
        # evicted or still being written) is a race, counted in `prefetch_wait`, not a cost of hits
        if wait is not None and loaded > 0 and t.fetch is not None:
            t.fetch.observe_prefetch_wait(loaded * t.fetch.bytes_per_token, wait, busy=t.busy())
    return None


def around_init_load_back(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """Set the L2 load-back threshold from the break-even length; measure L2->L1 loads."""
    t = state.tiers()
    threshold = load_back_threshold(t)
    if threshold is not None:
        self.load_back_threshold = threshold
    t0 = time.perf_counter()
    result = original(self, *args, **kwargs)
    dt = time.perf_counter() - t0
    if isinstance(result, tuple) and result:
        loaded = result[0]
        if isinstance(loaded, int) and loaded > 0:
            t.count("l2_loaded_tokens", loaded)
            if t.fetch is not None:
                t.fetch.observe_transfer("l2", loaded * t.fetch.bytes_per_token, dt)
    return result


def around_run_batch(original: Callable[..., Any], self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    result = original(self, batch, *args, **kwargs)
    t = state.current()
    mode = getattr(batch, "forward_mode", None)
    if t is not None and t.fetch is not None and mode is not None and mode.is_extend():
        tokens = int(getattr(batch, "extend_num_tokens", 0) or 0)
        if tokens > 0:
            t.fetch.observe_prefill(tokens, time.perf_counter() - t0, _attention_pairs(batch))
    return result


def _attention_pairs(batch: Any) -> int | None:
    """Sum over the batch's requests of new tokens x sequence length (None where not told)."""
    ext, pre = getattr(batch, "extend_lens", None), getattr(batch, "prefix_lens", None)
    if not ext or not pre or len(ext) != len(pre):
        return None
    return sum(int(e) * (int(p) + int(e)) for e, p in zip(ext, pre))
