"""SGLang 0.5.23's own black-box server kits (`sglang.test.kits`) against a real server on the CPU
platform, once per profile (`conformance_profiles.PROFILES`): stock SGLang, each plugin with the
flags that make it work, every plugin together, and kllm-router in front of stock. SmolLM2-135M
serves every profile (several kits check answers such as "paris"); float32, greedy.

The kits run unedited (`kit_runner.kit_case`); where a kit's numbers are sized for a GPU, its own
tuning attributes are set smaller (`TUNING`). A kit case that fails on stock SGLang as well is an
expected failure on every profile, with the reason (`STOCK_FAILS`); a case that fails with a
plugin only is a plugin bug, recorded in `PLUGIN_FAILS` with what fails. Kits not run, and why:

- `WaitingTimeoutMixin`, `RunningTimeoutTwoWaveMixin` (abort_timeout_kit): need a server started
  with SGLANG_REQ_WAITING_TIMEOUT / SGLANG_REQ_RUNNING_TIMEOUT and --max-running-requests 1.
- `StreamingSessionKitMixin`, `AbortLeakReproKitMixin`: need --enable-streaming-session.
- json/regex/ebnf constrained, reasoning, anthropic, VLM, spec-decoding, DSA, PD-parity, eval,
  lm_eval, KL, perf, forward-occupancy kits: grammar backends, reasoning/VLM/draft models, GPU
  kernels, PD pairs, or accuracy data sets that a CPU server with SmolLM2 does not have.
- `unified_radix_cache_kit` (server-level): gsm8k at 200 questions and 512-token KL turns, sized
  for a GPU; the white-box UnifiedRadixCache kits are in test_unified_radix_cache_kits.py.
"""
from __future__ import annotations

import random
from typing import Any

import pytest
import requests
from sglang.test.kits.abort_timeout_kit import AbortAllMixin
from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin
from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin
from sglang.test.kits.basic_scheduler_stress_kit import BasicSchedulerStressMixin
from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test
from sglang.test.kits.matched_stop_kit import MatchedStopMixin
from sglang.test.kits.prefix_cache_branching_kit import PrefixCacheBranchingMixin
from sglang.test.kits.radix_cache_server_kit import gen_radix_tree

from conformance_profiles import NOT_SERVED, PROFILES
from kit_runner import flush_cache, kit_case

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]  # each waits on a shared server (35-110 s to start)

PROFILE_NAMES = list(PROFILES)

# (kit, method); the slow ones (long decodes on a CPU) are marked slow
CASES: list[tuple[type, str]] = [
    *[(BasicAPIContractMixin, m) for m in ("test_health", "test_health_generate", "test_get_server_info",
                                           "test_get_model_info", "test_openai_chat_completion",
                                           "test_openai_completion")],
    *[(BasicSchedulerStressMixin, m) for m in ("test_streaming_response", "test_concurrent_requests",
                                               "test_long_prompt")],
    *[(BasicDecodeCorrectnessMixin, m) for m in ("test_capital_france", "test_basic_math",
                                                 "test_color_completion", "test_ascii_ratio",
                                                 "test_no_repetition_blowup", "test_determinism_temp_zero",
                                                 "test_max_token_one")],
    *[(MatchedStopMixin, m) for m in ("test_finish_stop_str", "test_finish_stop_regex_str",
                                      "test_finish_stop_eos", "test_finish_length")],
    (PrefixCacheBranchingMixin, "test_prefix_cache_branching"),
    (AbortAllMixin, "test_abort_all"),
]
# Cases of long decodes or prefills on a CPU (an ~8k-token prompt, 128-token answers, 8 decodes
# aborted): they run on stock and on every plugin together, not once per plugin (CI time on a
# 2-core machine); every other case runs on every profile.
SLOW = {"test_long_prompt", "test_finish_stop_eos", "test_abort_all", "test_concurrent_requests",
        "test_basic_math", "test_color_completion", "test_ascii_ratio", "test_no_repetition_blowup",
        "test_determinism_temp_zero", "test_finish_stop_regex_str"}
SLOW_PROFILES = ("stock", "all")

# kit attributes sized for a 2-core CPU (the kits' own knobs)
TUNING: dict[type, dict[str, Any]] = {
    AbortAllMixin: {"abort_all_num_requests": 8, "abort_all_max_new_tokens": 4000, "abort_all_sleep": 3},
}

# kit method -> why it fails on stock SGLang 0.5.23 on this platform as well (seen on the stock
# profile; each is an expected failure on every profile, strict on stock)
STOCK_FAILS: dict[str, str] = {
    "test_concurrent_requests": "SmolLM2-135M does not answer the kit's capitals after its 'single word' "
                                "system line (0/8 correct on stock); the kit expects a larger model",
    "test_basic_math": "SmolLM2-135M answers 17 x 23 with '17' (a model too small for the kit's arithmetic)",
    "test_prefix_cache_branching": "the kit expects no hit on the second prompt (a cache that only keeps "
                                   "chunk-aligned Mamba checkpoints); SGLang's full-attention radix cache "
                                   "hits the shared 256-token prefix, as it should",
    "test_long_prompt": "the kit's 120 s request timeout: an ~8k-token prefill of SmolLM2 takes longer on a "
                        "2-core CPU with torch_native attention",
}

# stock failures that depend on the machine's speed (not strict anywhere): on a quiet 2-core
# machine the ~8k-token prefill fits the kit's 120 s timeout (62.6 s in the full run), loaded it does not
TIMING_DEPENDENT = {"test_long_prompt"}

# (profile, kit method) -> what the kit found with that set-up only
PLUGIN_FAILS: dict[tuple[str, str], str] = {
}
ROUTER_BATCH = ("kllm-router refuses batched /generate (a list of input_ids) with a 400 by design: "
                "'send one request each'")


def _id(case: tuple[type, str]) -> str:
    return f"{case[0].__name__.removesuffix('Mixin')}.{case[1].removeprefix('test_')}"


@pytest.fixture(scope="module", params=PROFILE_NAMES)
def setup(request: pytest.FixtureRequest, server_pool: Any) -> Any:
    return server_pool.get(request.param)


def _marks(profile: str, method: str) -> list[Any]:
    marks = [pytest.mark.slow] if method in SLOW else []
    if method in STOCK_FAILS:
        marks.append(pytest.mark.xfail(reason=f"fails on stock SGLang too: {STOCK_FAILS[method]}",
                                       strict=profile == "stock" and method not in TIMING_DEPENDENT))
    if (profile, method) in PLUGIN_FAILS:
        marks.append(pytest.mark.xfail(reason=PLUGIN_FAILS[(profile, method)], strict=True))
    return marks


@pytest.mark.parametrize("setup,case", [
    pytest.param(p, c, marks=_marks(p, c[1]), id=f"{p}-{_id(c)}") for p in PROFILE_NAMES for c in CASES
    if c[1] not in SLOW or p in SLOW_PROFILES
], indirect=["setup"], scope="module")
def test_kit(setup: Any, case: tuple[type, str]) -> None:
    kit, method = case
    kit_case(kit, method, setup.base_url, setup.server.proc, flush_url=setup.server.base_url,
             cache_chunk_size=setup.profile.page_size, **TUNING.get(kit, {}))


def test_radix_cache_server_kit_tree(setup: Any, request: pytest.FixtureRequest) -> None:
    """radix_cache_server_kit: one /generate batch of prompts that form a random radix tree (the
    kit's own generator, seeded, 12 nodes of up to 16 tokens instead of 400 of 256: a CPU); every
    request answers with as many tokens as it asked for, and a second pass over the same tree hits
    the prefix cache for most of its prompt tokens."""
    if setup.profile.router:
        request.applymarker(pytest.mark.xfail(reason=ROUTER_BATCH, strict=True))
    random.seed(28)
    nodes = gen_radix_tree(num_nodes=12, chunk_len=16)
    for n in nodes:  # the kit's root asks for 217 tokens: at most 16 each here
        n["decode_len"] = min(n["decode_len"], 16)
    body = {"input_ids": [n["input_ids"] for n in nodes],
            "sampling_params": [{"max_new_tokens": n["decode_len"], "temperature": 0, "ignore_eos": True}
                                for n in nodes]}
    flush_cache(setup.server.base_url)
    res = requests.post(setup.base_url + "/generate", json=body, timeout=600)
    assert res.status_code == 200, res.text[:300]
    out = res.json()
    assert [len(o["output_ids"]) for o in out] == [n["decode_len"] for n in nodes]
    again = requests.post(setup.base_url + "/generate", json=body, timeout=600).json()
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in again)
    cached = sum(o["meta_info"]["cached_tokens"] for o in again)
    assert cached >= 0.8 * prompt - setup.profile.page_size * len(nodes), (cached, prompt)
    # greedy and the same batch: the same outputs
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


def test_cache_hit_kit_multiturn(setup: Any, sharegpt_small: Any) -> None:
    """cache_hit_kit.run_multiturn_cache_hit_test: rounds of a multi-turn workload; from round 1
    each client's previous prompt and output must be served from the cache (page-aligned)."""
    result = run_multiturn_cache_hit_test(setup.base_url, str(setup.server.args[setup.server.args.index("--model-path") + 1]),
                                          num_clients=4, num_rounds=3, request_length=96, output_length=8,
                                          dataset_path=str(sharegpt_small), max_parallel=4)
    assert result["rounds"]["round_2"]["cache_hit_rate"] > 0.5, result


def test_every_plugin_is_held_or_listed() -> None:
    """No plugin is left out silently: each installed plugin has a profile or a reason."""
    from importlib.metadata import entry_points

    from kllm_plugins.manager import ENTRY_POINT_GROUP

    served = {p for prof in PROFILES.values() for p in prof.plugins}
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert installed, "no plugin found"
    assert installed <= served | set(NOT_SERVED), installed - served - set(NOT_SERVED)
    assert not served & set(NOT_SERVED)
