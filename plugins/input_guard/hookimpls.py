"""Layer: hook implementations (no SGLang import). Declares the input_guard plugin to the host."""
from __future__ import annotations

from kllm_plugins.hookspecs import hookimpl
from kllm_plugins.plugins.input_guard.config import InputGuardConfig
from kllm_plugins.spec import PatchSpec, PluginSpec, options_from_config

ADAPTER = "kllm_plugins.plugins.input_guard.sglang_adapter"


@hookimpl
def kllm_declare() -> PluginSpec:
    return PluginSpec(
        name="input_guard",
        summary="refuses token ids outside the vocabulary (HTTP 400) instead of letting them crash the scheduler",
        status="experimental",
        options=options_from_config(InputGuardConfig),
        patches=(
            PatchSpec(
                target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                impl=f"{ADAPTER}:before_validate_one_request",
                kind="before",
                why="SGLang validates a prompt's length but not its token ids: an id past the embedding table "
                    "kills the scheduler (and the server); checked where SGLang checks the length, so the "
                    "ValueError becomes SGLang's own HTTP 400",
                upstream="a vocabulary check of input_ids in TokenizerManager._validate_one_request",
            ),
        ),
        config_factory=InputGuardConfig,
    )
