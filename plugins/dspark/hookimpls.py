"""Layer: hook implementations (no SGLang import). Declares the dspark plugin to the host.

Every SGLang target the plugin touches is listed here with why and what upstream change would
retire it; tests resolve each target against the installed SGLang.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.dspark.config import DsparkConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

logger = logging.getLogger("kllm.dspark")

ADAPTER = "kllm_plugins.plugins.dspark.sglang_adapter"
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner"
RAGGED_ENV = "SGLANG_RAGGED_VERIFY_MODE"

PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        target=f"{PLANNER}.compute_verify_token_budget",
        impl=f"{ADAPTER}:around_compute_verify_token_budget",
        kind="around",
        why="price the verify budget with the online cost model (context-aware) and the SLA "
        "objective; the stock function maximises throughput over a static SPS table",
        upstream="a pluggable budget policy / cost-model interface on HostConfidenceBudgetPlanner",
    ),
    PatchSpec(
        target=f"{PLANNER}.build_sps_cost_table",
        impl=f"{ADAPTER}:around_build_sps_cost_table",
        kind="around",
        why="the SPS table source: without --speculative-dspark-sps-table-path SGLang builds a flat "
        "table and compact mode pins every step to verify-all; give it a non-degenerate seed",
        upstream="sgl-project/sglang#35413 (derive the cost table online / at graph capture)",
    ),
    PatchSpec(
        target=f"{PLANNER}.DSparkVerifyPlanner.__init__",
        impl=f"{ADAPTER}:after_planner_init",
        kind="after",
        why="DSparkScheduleConfig hard-codes min_verify_len=1, max_verify_len=gamma+1 and eps",
        upstream="--speculative-dspark-min/max-verify-len server arguments",
    ),
    PatchSpec(
        target=f"{PLANNER}.DSparkVerifyPlanner.prepare_verify_budget",
        impl=f"{ADAPTER}:around_prepare_verify_budget",
        kind="around",
        why="the budget function never sees context length; read the batch's prefix lengths "
        "(overlap-scheduler path)",
        upstream="pass seq_lens to compute_verify_token_budget",
    ),
    PatchSpec(
        target=f"{PLANNER}.DSparkVerifyPlanner.compute_budget_sync",
        impl=f"{ADAPTER}:around_compute_budget_sync",
        kind="around",
        why="same as prepare_verify_budget, for the non-overlap path (prefix_lens is dropped there)",
        upstream="pass seq_lens to compute_verify_token_budget",
    ),
    PatchSpec(
        target=f"{PLANNER}.HostConfidenceBudgetPlanner.note_non_decode_step",
        impl=f"{ADAPTER}:after_note_non_decode_step",
        kind="after",
        why="an extend/prefill step breaks the decode cadence: do not time it as a verify step",
        upstream="a step-completed callback carrying the measured step time",
    ),
)


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="dspark",
        summary="DSPARK verify budget learned online from step times; throughput or per-user SLA objective",
        status="experimental",
        options=options_from_config(DsparkConfig),
        patches=PATCHES,
        config_factory=DsparkConfig,
    )


def apply_ragged_default(config: DsparkConfig, environ: Any = os.environ) -> str:
    """Make confidence-driven (ragged) verify the default while the plugin is on.

    SGLang builds the DSpark confidence head, and plans budgets at all, only when
    SGLANG_RAGGED_VERIFY_MODE is not "static" (its default). A value the user set wins.
    Returns the mode in effect.
    """
    current = environ.get(RAGGED_ENV)
    if current is None:
        environ[RAGGED_ENV] = config.ragged_mode
        return config.ragged_mode
    if current == "static":
        logger.warning("kllm dspark: %s=static was set explicitly; the verify planner stays off", RAGGED_ENV)
    return current


@hookimpl
def kllm_activate(config: DsparkConfig, role: str) -> None:
    mode = apply_ragged_default(config)
    if role == "main":
        logger.info(
            "kllm dspark: ragged verify mode=%s objective=%s sla=%.1f tok/s verify_len=[%d,%s]",
            mode,
            config.objective,
            config.sla_tokens_per_s,
            config.min_verify_len,
            config.max_verify_len or "gamma+1",
        )


@hookimpl
def kllm_readiness(config: Any, server_args: Any, environ: Any = os.environ) -> str | None:
    """The plugin prices SGLang's DSPARK verify planner, which exists only under DSPARK speculation
    with ragged verify."""
    algo = getattr(server_args, "speculative_algorithm", None)
    if str(algo or "").upper() != "DSPARK":
        return (f"dspark drives SGLang's DSPARK verify planner, but speculative decoding is {algo or 'off'}; add "
                "--speculative-algorithm DSPARK --speculative-draft-model-path <DSPARK draft with a confidence head> "
                "(CUDA/NPU/XPU: SGLang refuses DSPARK on other devices)")
    if environ.get(RAGGED_ENV) == "static":
        return f"{RAGGED_ENV}=static turns SGLang's verify planner off; unset it (default {config.ragged_mode})"
    return None
