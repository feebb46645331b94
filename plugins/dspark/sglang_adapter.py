"""Layer: SGLang adapter of the dspark plugin. The only module of the plugin that touches SGLang objects.

It translates SGLang's DSPARK planner calls into the core's terms (survival matrix, context
tokens, verify-token totals) and back (`VerifyBudgetDecision`). Every hook passes straight
through when the plugin is not enabled in the calling process.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from kllm_plugins import metrics, runtime
from kllm_plugins.plugins.dspark.config import DsparkConfig
from kllm_plugins.plugins.dspark.core.budget import BudgetPlanner, resolve_lens, verify_lens_for_budgets
from kllm_plugins.plugins.dspark.core.cost_model import OnlineStepCostModel, StepFeatures
from kllm_plugins.plugins.dspark.core.step_clock import StepClock
from kllm_plugins.stats import StatsWriter

logger = logging.getLogger("kllm.dspark")

NAME = "dspark"


class DsparkState:
    """Per-process planner state: cost model, planner, step clock, counters."""

    def __init__(self, config: DsparkConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.model = OnlineStepCostModel(config.cost_model_config())
        self.planner = BudgetPlanner(config.planner_config(), self.model)
        self.clock = StepClock(config.max_step_gap_s, clock)
        self._now = clock
        self.context_tokens = 0
        self.counts: dict[str, int] = {"model": 0, "explore": 0, "stock": 0}
        self.last: dict[str, Any] = {}
        self._writer: StatsWriter | None = None
        self._next_publish = 0.0
        self._failed = False
        self.ragged_blocked_by: str | None = None
        """The attention backend that cannot run ragged verify steps (then the plugin changes nothing)."""
        self.replicated_only = False
        """Set under tensor parallelism: every rank must compute the same budget (the graph tier
        is derived from it on each rank), and step times differ per rank, so the learned planner
        stands aside until a rank-0 broadcast of the decision exists."""

    def _publish(self) -> None:
        now = time.monotonic()
        if now < self._next_publish:  # build the snapshot only when it will be written
            return
        self._next_publish = now + self.config.publish_interval_s
        try:
            if self._writer is None:
                self._writer = StatsWriter(NAME, self.config.publish_interval_s)
            self._writer.update(self.snapshot, changed=True)
        except OSError as exc:  # stats are best effort; never break a decode step
            logger.debug("kllm dspark: stats not written: %s", exc)

    def snapshot(self) -> dict[str, Any]:
        return {"plans": dict(self.counts), "last": dict(self.last), "cost_model": self.model.snapshot(),
                "ragged_verify_blocked_by": self.ragged_blocked_by}

    def plan(self, original: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        from sglang.srt.speculative.dspark_components.dspark_planner import VerifyBudgetDecision

        now = self._now()
        survival_t = kwargs["history_survival_probs"]
        cfg = kwargs["cfg"]
        survival = survival_t.detach().to("cpu").double().numpy()
        num_reqs, gamma = survival.shape
        plan = self.planner.decide(survival, self.context_tokens)
        if plan is None:
            decision = original(**kwargs)
            source = "stock"
            lo, hi = resolve_lens(gamma, cfg.min_verify_len, cfg.resolved_max_verify_len())
            lens = verify_lens_for_budgets(survival, min_len=lo, max_len=hi, eps=cfg.survival_eps)
            verify_tokens = int(lens[min(int(decision.budget), lens.shape[0] - 1)].sum())
        else:
            source = plan.source
            secs = plan.step_seconds if np.isfinite(plan.step_seconds) else None
            thr = plan.throughput if np.isfinite(plan.throughput) else None
            decision = VerifyBudgetDecision(budget=plan.budget, predicted_step_seconds=secs, predicted_theta=thr)
            verify_tokens = plan.verify_tokens
        obs = self.clock.on_plan(StepFeatures(num_reqs, verify_tokens, self.context_tokens), now)
        if obs is not None:
            before = self.model.changes_detected
            self.model.observe(obs.features, obs.seconds)
            _metric("kllm_dspark_step_observations_total", "Verify step times fed to the cost model").inc()
            if self.model.changes_detected != before:
                _metric("kllm_dspark_cost_shifts_total", "Load changes detected by the cost model").inc()
        self.counts[source] += 1
        _metric("kllm_dspark_plans_total", "Verify budgets planned, by source", ("source",)).labels(source).inc()
        self.last = {
            "source": source,
            "num_reqs": num_reqs,
            "budget": int(decision.budget),
            "verify_tokens": verify_tokens,
            "context_tokens": self.context_tokens,
        }
        self._publish()
        return decision


def _metric(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    return metrics.counter(name, doc, labels)


_state: DsparkState | None = None


def state() -> DsparkState | None:
    """This process's planner state, created on first use; None when the plugin is off here."""
    global _state
    if not runtime.is_enabled(NAME):
        return None
    if _state is None:
        _state = DsparkState(runtime.config_of(NAME))
    return _state


def reset_state() -> None:
    """Forget the per-process state (tests; a config change)."""
    global _state
    _state = None


# -- hooks (see hookimpls.PATCHES for why each exists) ------------------------------------------


def around_compute_verify_token_budget(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    st = state()
    if st is None or args or st._failed:
        return original(*args, **kwargs)
    if st.replicated_only:
        st.counts["stock"] += 1
        return original(*args, **kwargs)
    try:
        return st.plan(original, kwargs)
    except Exception:  # noqa: BLE001 - a planner bug must not take the server down
        if runtime.strict():
            raise
        st._failed = True
        logger.exception("kllm dspark: planner failed; falling back to SGLang's budget for this process")
        return original(*args, **kwargs)


# SGLang 0.5.23 attention backends whose target-verify forward ignores the ragged verify layout (it
# reads every request as draft_token_num rows): a compact (ragged) verify step there reads past its
# rows, an illegal memory access on the GPU (seen with triton on the H100). flashinfer, fa3 and the
# trtllm backends read the layout.
NO_RAGGED_VERIFY = frozenset({"triton", "torch_native"})
_BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def _attention_backends() -> list[str]:
    """The attention backends in effect (the exec bag), else as the operator gave them."""
    names: list[Any] = []
    try:
        from sglang.srt.runtime_context import get_exec

        kernel = get_exec().kernel
        names += [getattr(kernel, f, None) for f in _BACKEND_FIELDS]
    except Exception:  # noqa: BLE001 - the bag is published only inside a server process
        pass
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        names += [getattr(args, f, None) for f in _BACKEND_FIELDS]
    except Exception:  # noqa: BLE001
        pass
    return [str(n) for n in names if n]


def ragged_verify_blocker() -> str | None:
    """The attention backend that cannot run a ragged verify step, if one is in effect."""
    return next((n for n in _attention_backends() if n in NO_RAGGED_VERIFY), None)


def around_build_sps_cost_table(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    table = original(*args, **kwargs)
    st = state()
    if st is None:
        return table
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable, is_uninitialized_sps_table

    blocker = ragged_verify_blocker()
    if blocker is not None:
        st.ragged_blocked_by = blocker
        logger.warning("kllm dspark: attention backend %s does not read ragged verify layouts in SGLang 0.5.23; "
                       "SGLang's table is kept (compact mode stays verify-all) and the plugin changes no budget",
                       blocker)
        return table
    if not is_uninitialized_sps_table(table):
        logger.info("kllm dspark: profiled SPS table kept as the fallback while the cost model warms up")
        return table
    # Flat over two probes: stock's argmax still picks verify-all while we warm up, but compact
    # mode no longer short-circuits every step to a uniform verify-all layout.
    top = max(2, int(table.max_batch_tokens))
    return SpsCostTable(sample_batch_tokens=[1, top], sample_steps_per_sec=[1.0, 1.0], max_batch_tokens=top)


def after_planner_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    st = state()
    if st is None:
        return None
    cfg = self._schedule_cfg
    lo, hi = resolve_lens(int(self.gamma), st.config.min_verify_len, st.config.max_verify_len)
    if st.config.max_verify_len and st.config.max_verify_len > self.gamma + 1:
        logger.warning("kllm dspark: max_verify_len %d > gamma+1=%d; using %d", st.config.max_verify_len, self.gamma + 1, hi)
    cfg.min_verify_len = lo
    cfg.max_verify_len = hi
    cfg.survival_eps = st.config.survival_eps
    cfg.validate()
    tp_group = getattr(getattr(self, "_tp_sync", None), "_tp_group", None)
    if int(getattr(tp_group, "world_size", 1) or 1) > 1:
        st.replicated_only = True
        logger.warning(
            "kllm dspark: tp_size>1: per-rank step times would make ranks disagree on the verify budget; "
            "the online planner is off (SGLang's own budget is used); verify-length options still apply"
        )
    if not self.schedules_verify_budget:
        logger.warning(
            "kllm dspark: SGLANG_RAGGED_VERIFY_MODE=%s: SGLang plans no verify budget, the plugin has no effect",
            self.mode_value,
        )
    else:
        logger.info("kllm dspark: planner attached (mode=%s, gamma=%d, verify_len=[%d,%d])", self.mode_value, self.gamma, lo, hi)
    return None


def _sum_lens(values: Any) -> int:
    if values is None:
        return 0
    try:
        return int(values.sum())
    except AttributeError:
        return int(sum(values))


def around_prepare_verify_budget(original: Callable[..., Any], self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    st = state()
    if st is not None:
        # The overlap scheduler resolves seq_lens_cpu right before this call; seq_lens_sum may lag.
        lens = getattr(batch, "seq_lens_cpu", None)
        total = getattr(batch, "seq_lens_sum", None)
        st.context_tokens = _sum_lens(lens) if lens is not None else int(total or 0)
    return original(self, batch, *args, **kwargs)


def around_compute_budget_sync(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    st = state()
    if st is not None and "prefix_lens" in kwargs:
        st.context_tokens = _sum_lens(kwargs["prefix_lens"])
    return original(self, *args, **kwargs)


def after_note_non_decode_step(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    st = state()
    if st is not None:
        st.clock.on_non_decode()
    return None
