"""Benchmark (SIMULATION): SGLang's real DSPARK verify planner, stock vs the kllm dspark plugin.

What is real and what is synthetic
----------------------------------
Real: SGLang 0.5.23's `DSparkVerifyPlanner` (built on CPU), its `HostConfidenceBudgetPlanner`
(two-step confidence lag), `compute_verify_token_budget`, the torch path of its top-k verify-length
allocator, and our hooks wrapped by SGLang's own HookRegistry wrapper.
Synthetic: the drafter (per-request acceptance rate alpha ~ Beta(6, 2), decaying 3% per position,
varying per step by N(0, 0.08); confidences = that per-step truth + N(0, 0.02), i.e. a calibrated
head), the accept process (chain acceptance), 32 requests with 3-6K-token prompts and 256-768
output tokens (finished ones are replaced), and the device: a verify step costs

    t = base + r*R + k_tok*max(M - knee, 0) + k_kv*C + k_att*M*mean(C)      (seconds)

for R requests, M verify tokens and C context tokens. DSPARK kernels cannot run on this CPU
machine nor on the project's GPU machine (no SGLang there), so no step here touched a GPU.

Load step: at half time a co-tenant takes compute: the per-token terms (k_tok, k_att) grow x3.

Planners:
  static        SGLANG_RAGGED_VERIFY_MODE=static (SGLang's default): verify gamma+1 always
  sps_offline   compact mode + an SpsAdditiveCostTable profiled offline under the phase-A load
                (exact for phase A, the best stock can do; stale after the load step)
  ours          the plugin, throughput objective, learning the cost online
  ours_sla      the plugin, objective=sla at --sla tokens/s per user
  oracle_cost   the plugin's planner given the true step cost instead of learning it (an upper
                bound for any budget chosen over SGLang's allocator with these confidences)
  fixed_L       every request verifies L tokens (the sweep behind "best fixed verify length")

Usage: python benchmarks/dspark/bench_planner.py [--steps 1200] [--seeds 3] [--no-record]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import numpy as np
import torch

os.environ.setdefault("SGLANG_RAGGED_VERIFY_MODE", "compact")

from kllm_plugins import runtime  # noqa: E402
from kllm_plugins.bench import stats  # noqa: E402
from kllm_plugins.bench.plot import figure  # noqa: E402
from kllm_plugins.bench.progress import track  # noqa: E402
from kllm_plugins.bench.record import result_path, update_sections  # noqa: E402
from kllm_plugins.attach import resolve_impl, resolve_target  # noqa: E402
from kllm_plugins.plugins.dspark import hookimpls  # noqa: E402
from kllm_plugins.plugins.dspark import sglang_adapter as adapter  # noqa: E402
from kllm_plugins.plugins.dspark.config import DsparkConfig  # noqa: E402

GAMMA = 7
ROOT = Path(__file__).resolve().parents[2]


# -- synthetic device -------------------------------------------------------------------------
@dataclass
class Device:
    base: float = 0.006
    r: float = 4e-5
    knee: int = 96
    k_tok: float = 3.5e-5
    k_kv: float = 1.2e-8
    k_att: float = 2.5e-9
    load: float = 1.0

    def step_seconds(self, num_reqs: int, verify_tokens: int, context_tokens: int) -> float:
        mean_c = context_tokens / max(num_reqs, 1)
        per_tok = self.k_tok * max(verify_tokens - self.knee, 0) + self.k_att * verify_tokens * mean_c
        return self.base + self.r * num_reqs + self.k_kv * context_tokens + self.load * per_tok

    def additive_table(self, mean_context: float, max_reqs: int) -> Any:
        """What SGLang's offline profiler would measure under this load and context mix."""
        from sglang.srt.speculative.dspark_components.dspark_sps import SpsAdditiveCostTable

        bs = sorted({1, 2, 4, 8, 16, 32, max_reqs, 64})
        ms = sorted({1, 16, 32, 64, self.knee, 128, 192, 256, 384, 512})
        return SpsAdditiveCostTable(
            bias_seconds=self.base,
            bs_probes=bs,
            alpha_seconds=[self.r * b + self.k_kv * b * mean_context for b in bs],
            m_probes=ms,
            theta_seconds=[self.load * (self.k_tok * max(m - self.knee, 0) + self.k_att * m * mean_context) for m in ms],
        )


# -- synthetic drafter and requests ----------------------------------------------------------
@dataclass
class Request:
    alpha: float
    context: int
    remaining: int
    started: float
    generated: int = 0


@dataclass
class Workload:
    rng: np.random.Generator
    num_reqs: int = 32
    decay: float = 0.97
    step_var: float = 0.08
    """Per-step variation of the true acceptance probabilities (some tokens are easy, some hard)."""
    conf_noise: float = 0.02
    """Confidence-head error around the per-step truth (calibrated: DSpark reports ECE ~1% after STS)."""
    out_len: tuple[int, int] = (256, 768)
    in_len: tuple[int, int] = (3000, 6000)
    slots: list[Request] = field(default_factory=list)
    generation: torch.Tensor = field(default_factory=lambda: torch.ones(256, dtype=torch.int64))

    def new_request(self, now: float) -> Request:
        alpha = float(np.clip(self.rng.beta(6, 2), 0.05, 0.98))
        return Request(alpha, int(self.rng.integers(*self.in_len)), int(self.rng.integers(*self.out_len)), now)

    def fill(self, now: float) -> None:
        while len(self.slots) < self.num_reqs:
            self.slots.append(self.new_request(now))

    def true_probs(self) -> np.ndarray:
        a = np.array([r.alpha for r in self.slots])[:, None]
        base = a * self.decay ** np.arange(GAMMA)[None, :]
        return np.clip(base + self.step_var * self.rng.standard_normal(base.shape), 0.01, 0.995)

    def confidences(self, probs: np.ndarray) -> torch.Tensor:
        noisy = probs + self.conf_noise * self.rng.standard_normal(probs.shape)
        return torch.tensor(np.clip(noisy, 0.01, 0.995), dtype=torch.float32)

    def accept(self, probs: np.ndarray, lens: list[int]) -> np.ndarray:
        """Accepted tokens per request (bonus included) for verify lengths `lens`."""
        ok = self.rng.random(probs.shape) < probs
        lead = np.cumprod(ok, axis=1)
        verified = np.arange(GAMMA)[None, :] < (np.asarray(lens)[:, None] - 1)
        return 1 + (lead * verified).sum(axis=1)


# -- planners --------------------------------------------------------------------------------
class OracleModel:
    """Stands in for the online cost model with the synthetic device's exact cost."""

    ready = True
    changes_detected = 0

    def __init__(self, device: Device) -> None:
        self.device = device

    def predict(self, num_reqs: Any, verify_tokens: Any, context_tokens: Any = 0) -> np.ndarray:
        m = np.atleast_1d(np.asarray(verify_tokens))
        out = np.array([self.device.step_seconds(int(num_reqs), int(x), int(context_tokens)) for x in m])
        return out if np.ndim(verify_tokens) else out[0]

    def observe(self, *_: Any) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"oracle": True}


@contextlib.contextmanager
def plugin_hooks(config: DsparkConfig, clock: Callable[[], float], oracle: Device | None = None) -> Iterator[None]:
    """Wrap every ledger target the way SGLang's HookRegistry does; restore on exit."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    saved = []
    for patch in hookimpls.PATCHES:
        parent_path, attr = patch.target.rsplit(".", 1)
        parent = resolve_target(parent_path)
        raw = parent.__dict__[attr] if isinstance(parent, type) else getattr(parent, attr)
        saved.append((parent, attr, raw))
        setattr(parent, attr, _wrap_fn(resolve_target(patch.target), resolve_impl(patch.impl), HookType[patch.kind.upper()]))
    runtime.set_config("dspark", config)
    adapter._state = adapter.DsparkState(config, clock=clock)
    if oracle is not None:
        adapter._state.model = adapter._state.planner.model = OracleModel(oracle)  # type: ignore[assignment]
    try:
        yield
    finally:
        for parent, attr, raw in saved:
            setattr(parent, attr, raw)
        runtime._configs.pop("dspark", None)
        adapter.reset_state()


def make_planner(workload: Workload) -> Any:
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkVerifyPlanner
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_generation=workload.generation, req_to_token=torch.zeros(256, 1)),
        decode_cuda_graph_runner=None,
    )
    return DSparkVerifyPlanner(
        draft_model=SimpleNamespace(confidence_head=SimpleNamespace()),
        gamma=GAMMA,
        model_runner=runner,
        device="cpu",
        tp_rank=0,
        verify_num_draft_tokens=GAMMA + 1,
        tp_sync=SpecTpSync(SimpleNamespace(world_size=1, rank_in_group=0)),
    )


@dataclass
class PhaseStats:
    tokens: float = 0.0
    seconds: float = 0.0
    verify_tokens: int = 0
    finished_speeds: list[float] = field(default_factory=list)
    step_tokens: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_meets: list[float] = field(default_factory=list)
    """Per step: fraction of requests whose expected speed (true acceptance) reaches the SLA."""

    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def sla_attainment(self, sla: float) -> float:
        s = self.finished_speeds
        return float(np.mean([v >= sla for v in s])) if s else float("nan")


def simulate(kind: str, seed: int, steps: int, sla: float, fixed_len: int = 0, conf_noise: float = 0.02) -> list[PhaseStats]:
    """Run `steps` decode steps (load step at steps // 2); return per-phase stats."""
    from sglang.srt.runtime_context import get_context

    rng = np.random.default_rng(seed)
    wl = Workload(rng, conf_noise=conf_noise)
    dev = Device()
    now = [0.0]
    wl.fill(now[0])
    mean_ctx_a = float(np.mean(wl.in_len)) + 256.0
    fields: dict[str, Any] = {"max_running_requests": 64, "disable_overlap_schedule": True}
    if kind == "sps_offline":
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kllm_dspark_sps_{os.getpid()}.json"
        path.write_text(dev.additive_table(mean_ctx_a, wl.num_reqs).to_json())
        fields["speculative_dspark_sps_table_path"] = str(path)
    mode = "static" if kind in ("static", "fixed") else "compact"
    stack = contextlib.ExitStack()
    prev_mode = os.environ.get("SGLANG_RAGGED_VERIFY_MODE")
    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = mode
    if kind in ("ours", "ours_sla", "oracle_cost", "oracle_sla"):
        sla_on, oracle = kind.endswith("_sla"), kind.startswith("oracle")
        cfg = DsparkConfig(objective="sla" if sla_on else "throughput", sla_tokens_per_s=sla if sla_on else 0.0,
                           explore_prob=0.0 if oracle else 0.02)
        stack.enter_context(plugin_hooks(cfg, clock=lambda: now[0], oracle=dev if oracle else None))
    phases = [PhaseStats(), PhaseStats()]
    with stack, get_context().override_server_args(**fields):
        planner = make_planner(wl)
        for i in range(steps):
            phase = 0 if i < steps // 2 else 1
            dev.load = 1.0 if phase == 0 else 3.0
            probs = wl.true_probs()
            conf = wl.confidences(probs)
            idx = torch.arange(len(wl.slots))
            prefix = torch.tensor([r.context for r in wl.slots])
            if kind == "fixed":
                lens = [fixed_len] * len(wl.slots)
            elif not planner.schedules_verify_budget:
                lens = [GAMMA + 1] * len(wl.slots)
            else:
                budget = planner.compute_budget_sync(confidence=conf, prefix_lens=prefix, req_pool_indices=idx)
                layout = planner.schedule_layout(
                    req_pool_indices=idx, prefix_lens=prefix, device=torch.device("cpu"), confidence=conf, budget=budget
                )
                lens = layout.verify_lens_cpu if layout is not None else [GAMMA + 1] * len(wl.slots)
            secs = dev.step_seconds(len(wl.slots), int(sum(lens)), int(prefix.sum()))
            got = wl.accept(probs, lens)
            if sla > 0:
                surv = np.cumprod(probs, axis=1)
                exp_tok = 1 + np.array([surv[j, : lens[j] - 1].sum() for j in range(len(lens))])
                phases[phase].step_meets.append(float((exp_tok / secs >= sla).mean()))
            now[0] += secs
            st = phases[phase]
            st.tokens += float(got.sum())
            st.seconds += secs
            st.verify_tokens += int(sum(lens))
            st.step_tokens.append(float(got.sum()))
            st.step_seconds.append(secs)
            for j, r in enumerate(list(wl.slots)):
                r.generated += int(got[j])
                r.context += int(got[j])
                r.remaining -= int(got[j])
                if r.remaining <= 0:
                    st.finished_speeds.append(r.generated / max(now[0] - r.started, 1e-9))
                    wl.slots[j] = wl.new_request(now[0])
                    wl.generation[j] += 1  # a new request in this slot: stale confidences are not fresh
    if prev_mode is None:
        os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
    else:
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = prev_mode
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1200, help="decode steps per run (load step at half)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sla", type=float, default=0.0,
                    help="per-user tokens/s for ours_sla (0: the median user speed of ours after the load step, so it binds)")
    ap.add_argument("--conf-noise", type=float, default=0.02, help="confidence error around the per-step truth")
    ap.add_argument("--no-record", action="store_true", help="do not write the results file")
    ap.add_argument("--out", default=str(result_path("dspark", "planner")),
                    help="combined dspark summary to update (section planner_simulation; default "
                         "benchmarks/results/dspark/planner.json)")
    ap.add_argument("--plot", default="", help="draw throughput per planner to this file (needs matplotlib)")
    args = ap.parse_args()
    logging_quiet()
    t0 = time.time()
    seeds = list(range(args.seeds))
    # SLA: the median user speed that ours (throughput objective) gives after the load step, so
    # the SLA binds for about half the users and the objectives can differ.
    ours = {s: simulate("ours", s, args.steps, 1.0, conf_noise=args.conf_noise) for s in track(seeds, "ours")}
    sla = args.sla or round(float(np.median([np.median(ours[s][1].finished_speeds) for s in seeds])), 1)
    runs: dict[str, dict[int, list[PhaseStats]]] = {}
    for kind in ("static", "sps_offline", "ours", "ours_sla", "oracle_cost"):
        if kind == "ours":
            runs[kind] = ours  # the SLA only enters its report, not its decisions
            continue
        runs[kind] = {s: simulate(kind, s, args.steps, sla, conf_noise=args.conf_noise)
                      for s in track(seeds, kind)}
    static = runs["static"]
    fixed = {L: {s: simulate("fixed", s, args.steps, 0.0, fixed_len=L, conf_noise=args.conf_noise) for s in seeds}
             for L in track(range(1, GAMMA + 2), "fixed sweep")}

    def med(kind_runs: dict[int, list[PhaseStats]], phase: int, what: str) -> tuple[float, float]:
        vals = [getattr(kind_runs[s][phase], what)() if what == "throughput" else kind_runs[s][phase].sla_attainment(sla) for s in seeds]
        return float(np.median(vals)), float(np.max(vals) - np.min(vals))

    def ratio(a: dict[int, list[PhaseStats]], b: dict[int, list[PhaseStats]], phase: int) -> float:
        """Median over seeds of the per-seed throughput ratio (same workload draws per seed)."""
        return float(np.median([a[s][phase].throughput() / b[s][phase].throughput() for s in seeds]))

    best_a = max(fixed, key=lambda L: med(fixed[L], 0, "throughput")[0])
    best_b = max(fixed, key=lambda L: med(fixed[L], 1, "throughput")[0])
    rows = [(k, runs[k]) for k in runs] + [(f"fixed_L{best_a} (best before)", fixed[best_a])]
    if best_b != best_a:
        rows.append((f"fixed_L{best_b} (best after)", fixed[best_b]))
    print("SIMULATION (SGLang's real DSPARK planner classes on CPU; synthetic drafter and step cost)")
    print(f"steps={args.steps} seeds={args.seeds} requests=32 gamma={GAMMA} conf_noise={args.conf_noise}; load step"
          f" x3 per-token cost at step {args.steps // 2}; SLA={sla} tok/s/user")
    print("throughput: accepted tokens per simulated second, median over seeds ± range; ratios: median of per-seed ratios")
    print(f"{'planner':28s} {'thr before':>11s} {'vs static':>9s} {'thr after':>10s} {'vs static':>9s} {'SLA before':>10s} {'SLA after':>9s}")
    for name, kr in rows:
        (ta, sa), (tb, sb) = med(kr, 0, "throughput"), med(kr, 1, "throughput")
        print(f"{name:28s} {ta:8.0f}±{sa:<3.0f}{ratio(kr, static, 0):8.3f}x {tb:8.0f}±{sb:<3.0f}{ratio(kr, static, 1):7.3f}x"
              f" {med(kr, 0, 'sla')[0]:10.2f} {med(kr, 1, 'sla')[0]:9.2f}")
    ours_r = runs["ours"]
    summary = {
        "online_vs_best_fixed": round(ratio(ours_r, fixed[best_a], 0), 4),
        "after_load_change_vs_best_fixed": round(ratio(ours_r, fixed[best_a], 1), 4),
        "after_load_change_vs_best_fixed_in_hindsight": round(ratio(ours_r, fixed[best_b], 1), 4),
        "best_fixed_verify_len": [best_a, best_b],
        "ours_vs_static": [round(ratio(ours_r, static, 0), 4), round(ratio(ours_r, static, 1), 4)],
        "ours_vs_oracle_cost": [round(ratio(ours_r, runs["oracle_cost"], 0), 4), round(ratio(ours_r, runs["oracle_cost"], 1), 4)],
        "ours_vs_sps_offline": [round(ratio(ours_r, runs["sps_offline"], 0), 4), round(ratio(ours_r, runs["sps_offline"], 1), 4)],
        "ours_sla_vs_ours_throughput": [round(ratio(runs["ours_sla"], ours_r, 0), 4), round(ratio(runs["ours_sla"], ours_r, 1), 4)],
        "sla_tokens_per_s": sla,
        "sla_attainment_after": {k: round(med(runs[k], 1, "sla")[0], 3) for k in runs},
        "conf_noise": args.conf_noise,
        "simulation": True,
    }
    metrics = harness_metrics(runs, fixed, best_a, best_b, seeds)
    print("summary:", json.dumps(summary))
    print("ratios of medians over seeds [per-seed min-max]: " + "; ".join(
        f"{k} {stats.fmt_spread(v)}" for k, v in metrics["ours_throughput_ratio"].items()))
    print(f"wall {time.time() - t0:.0f}s")
    command = "python benchmarks/dspark/bench_planner.py " + " ".join(sys.argv[1:])
    if not args.no_record:
        path = update_sections(args.out, "planner_simulation", command.strip(),
                               {"planner_simulation": summary, "simulation_command": command.strip()}, metrics=metrics)
        print(f"recorded {path}")
    if args.plot:
        draw(args.plot, rows, seeds)


def harness_metrics(runs: dict[str, dict[int, list[PhaseStats]]], fixed: dict[int, dict[int, list[PhaseStats]]],
                    best_a: int, best_b: int, seeds: list[int]) -> dict[str, Any]:
    """The figures in the harness's form: throughput spreads over seeds per planner and phase, and
    ours over each baseline as a ratio of medians with its per-seed spread (seeds are paired: the
    same workload draws)."""
    def thr(kind_runs: dict[int, list[PhaseStats]], phase: int) -> list[float]:
        return [kind_runs[s][phase].throughput() for s in seeds]

    phases = ("before", "after")
    bases = {"static": runs["static"], "sps_offline": runs["sps_offline"], "oracle_cost": runs["oracle_cost"],
             "best_fixed": fixed[best_a], "best_fixed_in_hindsight": fixed[best_b]}
    return {
        "throughput_tokens_per_s": {k: {ph: stats.spread(thr(kr, i)) for i, ph in enumerate(phases)}
                                    for k, kr in runs.items()},
        "ours_throughput_ratio": {f"vs_{b}_{ph}": stats.ratio_of_medians(thr(runs["ours"], i), thr(kr, i))
                                  for b, kr in bases.items() for i, ph in enumerate(phases)},
    }


def logging_quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("sglang", "kllm"):
        logging.getLogger(name).setLevel(logging.ERROR)


def draw(path: str, rows: list[tuple[str, dict[int, list[PhaseStats]]]], seeds: list[int]) -> None:
    with figure(path, size=(8, 4), dpi=100) as axes:
        if axes is not None:
            _bars(axes[0][0], rows, seeds)


def _bars(ax: Any, rows: list[tuple[str, dict[int, list[PhaseStats]]]], seeds: list[int]) -> None:
    names = [n for n, _ in rows]
    for phase, off in ((0, -0.2), (1, 0.2)):
        vals = [np.median([kr[s][phase].throughput() for s in seeds]) for _, kr in rows]
        ax.bar(np.arange(len(rows)) + off, vals, width=0.4, label=("before" if phase == 0 else "after") + " load step")
    ax.set_xticks(np.arange(len(rows)), names, rotation=20, ha="right")
    ax.set_ylabel("accepted tokens/s (simulated)")
    ax.legend()


if __name__ == "__main__":
    main()
