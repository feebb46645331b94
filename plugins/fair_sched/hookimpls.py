"""Layer: hook implementations (no SGLang import). Declares the fair_sched plugin to the host."""
from __future__ import annotations

from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.fair_sched.config import LOOP_ACTIONS, FairSchedConfig
from kllm_plugins.spec import OptionSpec, PatchSpec, PluginSpec, parse_bool

ADAPTER = "kllm_plugins.plugins.fair_sched.sglang_adapter"
PARTIALS = "kllm_plugins.plugins.fair_sched.sglang_partials"
INTERVAL = "kllm_plugins.plugins.fair_sched.sglang_interval"
LOOPS = "kllm_plugins.plugins.fair_sched.sglang_loops"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"

PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        target=f"{_SCHED}._get_new_batch_prefill_raw",
        impl=f"{ADAPTER}:around_get_new_batch_prefill_raw",
        kind="around",
        why="plan each pass: the long prefill's yield (decode step or one-chunk requests, with chunked_req "
        "detached for that pass so no inflight_middle_chunks is counted for a request not in the batch), "
        "its chunk cap, and the KV watermark admission gate",
        upstream="a per-pass prefill-planning hook, and parking a chunked request without the "
        "unconditional inflight_middle_chunks increment (scheduler.py:4329)",
    ),
    PatchSpec(
        target=f"{_SCHED}.abort_request",
        impl=f"{PARTIALS}:around_abort_request",
        kind="around",
        why="max_partial_prefills > 1: an abort of a partially prefilled request that fair_sched set aside finds it in "
        "no SGLang queue; noted, the request is put back as chunked_req and handed to SGLang's chunked abort",
        upstream="a list of partially prefilled requests in the scheduler (chunked_req as one of several), which "
        "abort and retraction would walk",
    ),
    PatchSpec(
        target=f"{_SCHED}._should_defer_prefill",
        impl=f"{INTERVAL}:around_should_defer_prefill",
        kind="around",
        why="--prefill-decode-interval: a round SGLang decodes without planning a prefill never reaches the "
        "pass planner; it is counted and timed as a decode step, so the decode rules add none right after it",
        upstream="the per-pass prefill-planning hook (above), called on deferred rounds too",
    ),
    PatchSpec(
        target=f"{_POLICY}.calc_priority",
        impl=f"{ADAPTER}:around_calc_priority",
        kind="around",
        why="admission order: by key = prefill tokens processed at arrival + age_weight x uncached prompt (earliest deadline first on SGLang's hrrn clock)",
        upstream="a registry of schedule policies (--schedule-policy NAME from a plugin)",
    ),
    PatchSpec(
        target=f"{_POLICY}.shortest_prefill_chunk_limit",
        impl=f"{ADAPTER}:around_shortest_prefill_chunk_limit",
        kind="around",
        why="cap the continuing chunk so waiting earlier-key requests share the pass or ride beside it (the stock cap exists only for shortest-prefill-first)",
        upstream="a chunk-limit hook that is not tied to one built-in policy",
    ),
    PatchSpec(
        target=f"{_SCHED}.get_prefill_adder_class",
        impl=f"{ADAPTER}:around_get_prefill_adder_class",
        kind="around",
        why="PrefillAdder subclass: refuse a second partially prefilled request (stock refuses it only under "
        "shortest-prefill-first), admit nothing while the watermark gate is closed, add the riding "
        "earlier-key requests' extra tokens to the pass's chunk budget, and cut or park a continuing chunk "
        "the free KV cannot hold (single-pool PrefillBudget.available_chunk_tokens returns a whole chunk "
        "once the budget is spent; the allocation then fails and the server exits)",
        upstream="none needed: this is SGLang's override point; a policy-neutral 'one chunked request' guard would "
        "drop the refusal, and parking the chunk on a spent budget (as sgl-project/sglang#30743 proposed) the guard",
    ),
    PatchSpec(
        target="sglang.srt.managers.schedule_batch.Req.update_finish_state",
        impl=f"{LOOPS}:around_update_finish_state",
        kind="around",
        why="cut outputs caught in a repetition loop with a clear finish reason (their KV is then freed by the normal finish path)",
        upstream="a pluggable stop-condition hook on Req",
    ),
    PatchSpec(
        target=f"{_SCHED}.update_running_batch",
        impl=f"{LOOPS}:around_update_running_batch",
        kind="around",
        why="loop_action=retract: before the decode step, release the KV of outputs caught in a repetition loop "
        "and requeue them (where SGLang itself retracts under memory pressure)",
        upstream="a retraction hook that lets a plugin name requests to retract",
    ),
    PatchSpec(
        target="sglang.srt.managers.load_snapshot.LoadSnapshot.to_dict",
        impl=f"{ADAPTER}:around_load_snapshot_to_dict",
        kind="around",
        why="publish the fair_sched section (KV usage, watermark state, long-request queue, quota) in /v1/loads, "
        "JSON and Prometheus, where a router already reads the engine's load",
        upstream="an extension field in LoadSnapshot that plugins may fill from the scheduler",
    ),
)


@hookimpl
def kllm_declare() -> PluginSpec:
    d = FairSchedConfig()
    return PluginSpec(
        name="fair_sched",
        summary="fair prefill scheduling (earliest deadline first by prompt size and age, riders beside the chunked prefill, yields with growing quotas) "
        "and decode KV protection (watermark gate, repetition-loop cut)",
        status="experimental",
        options=(
            OptionSpec("budget_tokens", int, d.budget_tokens, "new KV tokens per pass (0: --chunked-prefill-size)"),
            OptionSpec("base_quota_tokens", int, d.base_quota_tokens, "tokens a long prefill runs before its first yield (0: one budget)"),
            OptionSpec("quota_growth", float, d.quota_growth, "quota multiplier after each yield (>= 1)"),
            OptionSpec("max_quota_tokens", int, d.max_quota_tokens, "largest turn quota (0: four budgets)"),
            OptionSpec("max_yields", int, d.max_yields, "yields after which a long prefill never yields again"),
            OptionSpec("long_min_share", float, d.long_min_share, "fraction of the pass budget the active long prefill keeps"),
            OptionSpec("decode_every_chunks", int, d.decode_every_chunks, "decode step after this many long-prefill chunks while requests decode (0: never)"),
            OptionSpec("decode_interval_s", float, d.decode_interval_s, "a decode step also waits until the last one is this old (0: chunk count only)"),
            OptionSpec("busy_decode_reqs", int, d.busy_decode_reqs, "while at least this many requests decode, a decode step after every long chunk (0: off)"),
            OptionSpec("decode_share", float, d.decode_share, "while prefills wait, decode steps take about this share of the time (0: off)"),
            OptionSpec("decode_time_share", float, d.decode_time_share,
                       "while prompts wait, decode steps take at least this share of the time, several in a row when behind (0: off)"),
            OptionSpec("decode_max_gap_s", float, d.decode_max_gap_s, "a decode step after any long chunk once the last decode is this old (0: off)"),
            OptionSpec("short_extra_tokens", int, d.short_extra_tokens, "pass tokens beyond the budget for earlier-key requests riding along the chunked prefill (-1: three budgets, 0: off)"),
            OptionSpec("age_weight", float, d.age_weight, "order key = prefill tokens processed at arrival + age_weight x uncached prompt (0: FCFS)"),
            OptionSpec("mixed_decode", parse_bool, d.mixed_decode, "running requests decode inside every prefill pass (SGLang's mixed chunk)"),
            OptionSpec("chunk_guard", parse_bool, d.chunk_guard, "cut or park a continuing chunk the free KV cannot hold (stock SGLang overcommits it and the server exits)"),
            OptionSpec("chunk_guard_decode_steps", int, d.chunk_guard_decode_steps, "decode steps of KV (running rows x steps) the chunk guard keeps free when a continuing chunk takes the last free KV (0: none)"),
            OptionSpec("kv_high_watermark", float, d.kv_high_watermark, "KV usage that pauses admission of new requests"),
            OptionSpec("kv_low_watermark", float, d.kv_low_watermark, "KV usage below which admission resumes"),
            OptionSpec("loop_min_tokens", int, d.loop_min_tokens, "cut outputs repeating a short period this long (0: off)"),
            OptionSpec("loop_max_period", int, d.loop_max_period, "longest repeating period the loop detector looks for"),
            OptionSpec("loop_action", str, d.loop_action, "what to do with a looping output", choices=LOOP_ACTIONS),
            OptionSpec("loop_max_retracts", int, d.loop_max_retracts, "loop retractions of one request before its next loop finishes it"),
            OptionSpec("max_partial_prefills", int, d.max_partial_prefills, "requests partially prefilled at once: above 1, an earlier-key request larger than a pass sets the partial one aside (KV kept) and starts its own"),
            OptionSpec("max_long_partial_prefills", int, d.max_long_partial_prefills, "of those, at most this many with more than long_partial_tokens of work"),
            OptionSpec("long_partial_tokens", int, d.long_partial_tokens, "work above which a partial prefill counts as long (0: 16 budgets)"),
            OptionSpec("publish_interval_s", float, d.publish_interval_s, "seconds between snapshots for /kllm/stats"),
        ),
        patches=PATCHES,
        config_factory=FairSchedConfig,
    )


@hookimpl
def kllm_readiness(config: Any, server_args: Any) -> str | None:
    """The fair policy plans chunked-prefill passes; without chunked prefill it stays off."""
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if chunk is not None and int(chunk) <= 0:
        return f"chunked prefill is disabled (--chunked-prefill-size {chunk}); give it a positive size (e.g. 2048)"
    return None
