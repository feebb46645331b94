"""Real SGLang DSPARK planner classes on CPU, with synthetic confidences and a synthetic cost.

SGLang's DSPARK kernels need CUDA/NPU/XPU, but its planner (`DSparkVerifyPlanner`,
`HostConfidenceBudgetPlanner`, `compute_verify_token_budget`, the top-k allocator's torch path)
is plain torch and runs here. These tests build it for real and show what our hooks change.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from kllm_plugins import runtime
from kllm_plugins.attach import resolve_impl, resolve_target
from kllm_plugins.plugins.dspark import hookimpls
from kllm_plugins.plugins.dspark import sglang_adapter as adapter
from kllm_plugins.plugins.dspark.config import DsparkConfig
from kllm_plugins.plugins.dspark.core.budget import expected_tokens, plan_budget, verify_lens_for_budgets
from kllm_plugins.plugins.dspark.core.cost_model import StepFeatures

pytestmark = pytest.mark.sglang

P = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_planner")
from sglang.kernels.ops.speculative.dspark.dspark_schedule import schedule_verify_lens_topk_from_survival  # noqa: E402
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.speculative.dspark_components.dspark_sps import SpsAdditiveCostTable  # noqa: E402
from sglang.srt.speculative.spec_tp_sync import SpecTpSync  # noqa: E402

GAMMA = 7


def test_every_patch_target_resolves_against_installed_sglang() -> None:
    for patch in hookimpls.PATCHES:
        assert resolve_target(patch.target) is not None, patch.target
        assert callable(resolve_impl(patch.impl)), patch.impl


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("min_len,max_len", [(1, 8), (2, 8), (1, 5), (3, 6)])
def test_our_allocator_replay_matches_sglangs_topk(seed: int, min_len: int, max_len: int) -> None:
    rng = np.random.default_rng(seed)
    conf = rng.choice([0.0, 0.2, 0.5, 0.8, 0.9, 1.0], size=(6, GAMMA))
    survival = np.cumprod(conf, axis=1)
    cfg = P.DSparkScheduleConfig(gamma=GAMMA, min_verify_len=min_len, max_verify_len=max_len)
    ours = verify_lens_for_budgets(survival, min_len=min_len, max_len=max_len, eps=cfg.survival_eps)
    for b in range(ours.shape[0] + 3):
        theirs = schedule_verify_lens_topk_from_survival(
            survival_probs=torch.tensor(survival, dtype=torch.float32), budget=b, cfg=cfg
        )
        assert ours[min(b, ours.shape[0] - 1)].tolist() == theirs.tolist(), b


@pytest.mark.parametrize("seed", range(6))
def test_same_cost_same_budget_as_stock(seed: int) -> None:
    """With SGLang's own additive SPS table as the cost and min_len=1, our objective picks the
    budget stock picks: the plugin changes the price, not the meaning of the budget."""
    rng = np.random.default_rng(seed)
    survival = np.cumprod(rng.uniform(0.3, 1.0, size=(int(rng.integers(1, 12)), GAMMA)), axis=1)
    table = SpsAdditiveCostTable(
        bias_seconds=0.006,
        bs_probes=[1, 64],
        alpha_seconds=[0.0, 0.003],
        m_probes=[1, 64, 128, 512],
        theta_seconds=[0.0, 0.0005, 0.004, 0.03],
    )
    cfg = P.DSparkScheduleConfig(gamma=GAMMA)
    stock = P.compute_verify_token_budget(
        history_survival_probs=torch.tensor(survival, dtype=torch.float32), sps_table=table, cfg=cfg
    )
    r = survival.shape[0]
    ours = plan_budget(
        survival.astype(np.float32).astype(np.float64),
        lambda m: np.array([table.step_time(num_reqs=r, budget=int(x) - r) for x in np.atleast_1d(m)]),
        min_len=1,
        max_len=GAMMA + 1,
    )
    assert ours.budget == stock.budget


# -- the real DSparkVerifyPlanner, with our hooks wrapped the way SGLang's HookRegistry wraps them --


def install_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    for patch in hookimpls.PATCHES:
        parent_path, attr = patch.target.rsplit(".", 1)
        parent = resolve_target(parent_path)
        original = resolve_target(patch.target)
        wrapped = _wrap_fn(original, resolve_impl(patch.impl), HookType[patch.kind.upper()])
        monkeypatch.setattr(parent, attr, wrapped)


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[DsparkConfig], None]]:
    def enable(config: DsparkConfig) -> None:
        monkeypatch.delenv(hookimpls.RAGGED_ENV, raising=False)
        install_hooks(monkeypatch)
        runtime.set_config("dspark", config)
        adapter.reset_state()
        hookimpls.kllm_activate(config=config, role="main")

    yield enable
    runtime._configs.pop("dspark", None)
    adapter.reset_state()
    os.environ.pop(hookimpls.RAGGED_ENV, None)


def make_planner(bs_pool: int = 64, tp_size: int = 1) -> Any:
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(
            req_generation=torch.ones(bs_pool, dtype=torch.int64), req_to_token=torch.zeros(bs_pool, 4)
        ),
        decode_cuda_graph_runner=None,
    )
    return P.DSparkVerifyPlanner(
        draft_model=SimpleNamespace(confidence_head=SimpleNamespace()),
        gamma=GAMMA,
        model_runner=runner,
        device="cpu",
        tp_rank=0,
        verify_num_draft_tokens=GAMMA + 1,
        # a one-process stand-in for a TP group: broadcast from rank 0 leaves values as they are
        tp_sync=SpecTpSync(SimpleNamespace(world_size=tp_size, rank_in_group=0, broadcast=lambda values, src: values)),
    )


def step(planner: Any, conf: torch.Tensor, prefix: torch.Tensor) -> tuple[int, list[int]]:
    idx = torch.arange(conf.shape[0])
    budget = planner.compute_budget_sync(confidence=conf, prefix_lens=prefix, req_pool_indices=idx)
    layout = planner.schedule_layout(
        req_pool_indices=idx, prefix_lens=prefix, device=torch.device("cpu"), confidence=conf, budget=budget
    )
    return budget, (layout.verify_lens_cpu if layout is not None else [])


def confidences(bs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = 0.6 + 0.4 * torch.rand(bs, 1, generator=g)
    return (hi * torch.ones(bs, GAMMA)).clamp(max=0.99)


def compute_bound(m: float, ctx: float = 0.0) -> float:
    return 0.004 + 0.0006 * m + 2e-8 * ctx


def teach(st: adapter.DsparkState, cost: Callable[[float, float], float], bs: int, ctx: int) -> None:
    for m in range(bs, bs * (GAMMA + 1) + 1, 2):
        st.model.observe(StepFeatures(bs, m, ctx), cost(m, ctx))


def test_stock_planner_verifies_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hookimpls.RAGGED_ENV, "compact")
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        budget, lens = step(planner, confidences(8), torch.full((8,), 500))
    assert planner.is_verify_all
    assert budget == 8 * GAMMA and lens == [GAMMA + 1] * 8


def test_plugin_changes_the_budget_sglang_computes(plugin_on: Callable[[DsparkConfig], None]) -> None:
    plugin_on(DsparkConfig(explore_prob=0.0, warmup_explore_prob=0.0))
    assert os.environ[hookimpls.RAGGED_ENV] == "compact"  # ragged verify on by default
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        assert not planner.is_verify_all  # the seeded SPS source un-pins compact mode
        conf, prefix = confidences(8), torch.full((8,), 500)
        warm_budget, _ = step(planner, conf, prefix)
        assert warm_budget == 8 * GAMMA  # untrained: SGLang's own decision (verify-all)
        st = adapter.state()
        assert st is not None and st.counts["stock"] == 1
        teach(st, compute_bound, 8, 8 * 500)
        budget, lens = step(planner, conf, prefix)
    assert st.counts["model"] == 1
    assert 0 < budget < 8 * GAMMA
    surv = np.cumprod(conf.numpy().astype(np.float64), axis=1)
    best = plan_budget(surv, lambda m: np.array([compute_bound(x, 4000) for x in np.atleast_1d(m)]),
                       min_len=1, max_len=GAMMA + 1)
    assert abs(budget - best.budget) <= 2
    assert sum(lens) == 8 + budget
    # confident requests verify more than unconfident ones
    order = torch.argsort(conf[:, 0])
    assert lens[int(order[-1])] >= lens[int(order[0])]


@pytest.mark.parametrize("backend,ragged", [("triton", False), ("torch_native", False), ("flashinfer", True), ("fa3", True)])
def test_ragged_verify_only_where_the_attention_backend_reads_it(
        plugin_on: Callable[[DsparkConfig], None], monkeypatch: pytest.MonkeyPatch, backend: str, ragged: bool) -> None:
    """On an attention backend whose verify forward ignores SGLang's ragged layout (triton: an
    illegal memory access on the H100), the plugin keeps SGLang's table: compact mode stays
    verify-all, as stock, and the reason is in the stats."""
    monkeypatch.setattr(adapter, "_attention_backends", lambda: [backend])
    plugin_on(DsparkConfig(explore_prob=0.0, warmup_explore_prob=0.0))
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        budget, lens = step(planner, confidences(8), torch.full((8,), 500))
    st = adapter.state()
    assert st is not None
    assert planner.is_verify_all is (not ragged)
    assert st.snapshot()["ragged_verify_blocked_by"] == (None if ragged else backend)
    if not ragged:
        assert budget == 8 * GAMMA and lens == [GAMMA + 1] * 8  # what stock does


def test_tensor_parallel_keeps_sglangs_replicated_budget(plugin_on: Callable[[DsparkConfig], None]) -> None:
    """Under TP every rank must reach the same budget; per-rank timings cannot guarantee it, so
    the learned planner stands aside there while the verify-length options still apply."""
    plugin_on(DsparkConfig(max_verify_len=6, explore_prob=0.0, warmup_explore_prob=0.0))
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner(tp_size=2)
        st = adapter.state()
        assert st is not None and st.replicated_only
        teach(st, compute_bound, 8, 8 * 500)
        budget, lens = step(planner, confidences(8), torch.full((8,), 500))
    assert st.counts["model"] == 0 and st.counts["stock"] == 1
    assert lens == [6] * 8  # stock's argmax over the flat seed table verifies all it may


def test_min_and_max_verify_len_reach_sglangs_schedule(plugin_on: Callable[[DsparkConfig], None]) -> None:
    plugin_on(DsparkConfig(min_verify_len=2, max_verify_len=5, explore_prob=0.0, warmup_explore_prob=0.0))
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        assert (planner._schedule_cfg.min_verify_len, planner._schedule_cfg.max_verify_len) == (2, 5)
        conf = confidences(6, seed=3)
        conf[0] = 0.0  # a hopeless request still verifies the floor
        _, lens = step(planner, conf, torch.full((6,), 100))
    assert min(lens) >= 2 and max(lens) <= 5
    assert lens[0] == 2 and max(lens) == 5


def test_overlap_path_reads_context_and_sets_the_draft_budget(plugin_on: Callable[[DsparkConfig], None]) -> None:
    """The overlap scheduler calls prepare_verify_budget(batch, future_map): our hook reads the
    batch's context and SGLang stores our budget on the draft input."""
    from sglang.srt.managers.overlap_utils import ResolvedConfidence

    plugin_on(DsparkConfig(explore_prob=0.0, warmup_explore_prob=0.0))
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        st = adapter.state()
        assert st is not None
        teach(st, compute_bound, 8, 8 * 3000)
        conf = confidences(8)
        batch = SimpleNamespace(
            spec_info=SimpleNamespace(verify_token_budget=None),
            forward_mode=SimpleNamespace(is_extend=lambda: False),
            is_extend_in_batch=False,
            req_pool_indices_cpu=torch.arange(8),
            seq_lens_cpu=torch.full((8,), 3000),
            batch_size=lambda: 8,
            spec_verify_tier_num_tokens=None,
        )
        future_map = SimpleNamespace(
            resolve_confidence_cpu=lambda b: ResolvedConfidence(confidence=conf, generation=torch.ones(8, dtype=torch.int64))
        )
        planner.prepare_verify_budget(batch, future_map)
    assert st.context_tokens == 8 * 3000
    assert st.last["source"] == "model" and st.last["context_tokens"] == 8 * 3000
    assert batch.spec_info.verify_token_budget == st.last["budget"] < 8 * GAMMA
    assert batch.spec_verify_tier_num_tokens == 8 + st.last["budget"]


def test_context_length_changes_the_budget(plugin_on: Callable[[DsparkConfig], None]) -> None:
    plugin_on(DsparkConfig(explore_prob=0.0, warmup_explore_prob=0.0))

    def cost(m: float, ctx: float) -> float:  # attention over context dominates at long context
        return 0.004 + 0.0001 * m + 3e-9 * m * ctx

    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        st = adapter.state()
        assert st is not None
        for ctx in (8 * 200, 8 * 4000, 8 * 16000):
            teach(st, cost, 8, ctx)
        conf = confidences(8, seed=5)
        short, _ = step(planner, conf, torch.full((8,), 200))
        long, _ = step(planner, conf, torch.full((8,), 16000))
    assert long < short


def test_load_step_readapts_through_the_real_planner(plugin_on: Callable[[DsparkConfig], None]) -> None:
    """A co-tenant makes verify tokens 4x dearer at step 150: the budget SGLang receives moves
    to the new optimum without any table being re-profiled."""
    plugin_on(DsparkConfig(explore_prob=0.05, warmup_explore_prob=0.5, refit_every=1))
    clock = [0.0]
    st = adapter.DsparkState(runtime.config_of("dspark"), clock=lambda: clock[0])
    adapter._state = st
    bs, prefix = 8, torch.full((8,), 500)
    conf = confidences(bs, seed=11)
    surv = np.cumprod(conf.numpy().astype(np.float64), axis=1)

    def cost(m: float, load: float) -> float:
        return 0.006 + load * 0.0002 * max(m - 8, 0)

    lens_all = verify_lens_for_budgets(surv, min_len=1, max_len=GAMMA + 1)

    def true_throughput(b: int, load: float) -> float:
        lens = lens_all[min(b, lens_all.shape[0] - 1)]
        return float(expected_tokens(surv, lens).sum()) / cost(float(lens.sum()), load)

    def best(load: float) -> float:
        return max(true_throughput(b, load) for b in range(lens_all.shape[0]))

    budgets: list[tuple[int, str]] = []
    with get_context().override_server_args(max_running_requests=16):
        planner = make_planner()
        for i in range(300):
            load = 1.0 if i < 150 else 4.0
            budget, lens = step(planner, conf, prefix)
            budgets.append((budget, st.last["source"]))
            clock[0] += cost(sum(lens), load) * (1 + 0.02 * np.sin(i))
    verify_all = lens_all.shape[0] - 1
    # the change matters: after it, verify-all (stock without a fresh table) loses >15%
    assert true_throughput(verify_all, 4.0) < 0.85 * best(4.0)
    ratio_before = [true_throughput(b, 1.0) / best(1.0) for b, s in budgets[100:150] if s == "model"]
    ratio_after = [true_throughput(b, 4.0) / best(4.0) for b, s in budgets[150 + ADAPT : 300] if s == "model"]
    assert np.median(ratio_before) > 0.97
    assert np.median(ratio_after) > 0.97
    assert st.model.changes_detected >= 1


ADAPT = 40
"""Steps after the load change before the planner must be back near the optimum."""


def test_hooks_attach_through_sglangs_hook_registry() -> None:
    """End to end in a fresh process: the host attaches the ledger through SGLang's real
    HookRegistry, verifies each target, and the real planner's budget changes."""
    code = textwrap.dedent(
        """
        import os
        from types import SimpleNamespace
        import torch
        from kllm_plugins.manager import KllmPluginManager
        from kllm_plugins.sglang_bridge import Host
        from kllm_plugins.plugins.dspark import hookimpls, sglang_adapter as adapter
        from kllm_plugins.plugins.dspark.core.cost_model import StepFeatures
        h = Host(KllmPluginManager(extra_plugins=[("dspark", hookimpls)], load_entry_points=False))
        h.enable(["dspark"])
        rep = h.reports[-1]
        assert not rep.failures and len(rep.results) == len(hookimpls.PATCHES), rep.results
        assert os.environ["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
        from sglang.srt.runtime_context import get_context
        from sglang.srt.speculative.dspark_components import dspark_planner as P
        from sglang.srt.speculative.spec_tp_sync import SpecTpSync
        with get_context().override_server_args(max_running_requests=8):
            runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(
                req_generation=torch.ones(16, dtype=torch.int64), req_to_token=torch.zeros(16, 4)),
                decode_cuda_graph_runner=None)
            pl = P.DSparkVerifyPlanner(draft_model=SimpleNamespace(confidence_head=SimpleNamespace()),
                gamma=7, model_runner=runner, device="cpu", tp_rank=0, verify_num_draft_tokens=8,
                tp_sync=SpecTpSync(SimpleNamespace(world_size=1, rank_in_group=0)))
            st = adapter.state()
            for m in range(4, 33):
                st.model.observe(StepFeatures(4, m, 400), 0.004 + 0.001 * m)
            conf = torch.tensor([[0.95] * 7, [0.9] * 7, [0.4] * 7, [0.2] * 7])
            budgets = [pl.compute_budget_sync(confidence=conf, prefix_lens=torch.full((4,), 100),
                                              req_pool_indices=torch.arange(4)) for _ in range(20)]
        print("BUDGETS", budgets, st.counts)
        assert st.counts["model"] >= 15 and sorted(budgets)[10] < 28
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLLM_") and k != hookimpls.RAGGED_ENV}
    env.update({"KLLM_DSPARK_WARMUP_EXPLORE_PROB": "0", "KLLM_STRICT": "1"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BUDGETS" in out.stdout
