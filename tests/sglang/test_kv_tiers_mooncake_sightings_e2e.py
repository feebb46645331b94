"""End to end: selective persistence across instances on the Mooncake store (shared sightings).

Two real SGLang servers on one test-started `mooncake_master`, with `min_reuse` 2 (selection on,
no write-all): A's prefill is the prompt pages' first sighting (skipped, offer markers left in
the store), B's prefill their second (written by B, though B itself sees them for the first
time), and A, flushed, then loads them from L3, with the output equal to transformers' greedy
output (float32), i.e. to a run without tiers.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

import pytest

from kllm_plugins.models.tiny_llama import tiny_llama_path
from kllm_plugins.testing.hf_reference import hf_greedy
from kllm_plugins.plugins.kv_tiers.testing import assert_loads_from_l3, l3_args, mooncake_available, mooncake_master, wait_stats
from kllm_plugins.testing.sglang_server import SGLangServer, start_all

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

PROMPT = list(range(40, 340))  # 300 tokens: 18 full pages of 16
PAGES = 18
ARGS = ["--page-size", "16", "--dtype", "float32", "--hicache-storage-prefetch-policy", "wait_complete"]
ENV = {"KLLM_EXTRA_PLUGINS": "kllm_plugins.plugins.kv_tiers.hookimpls",
       # the L3 path itself is tested; learned fetch-or-recompute may rightly pick recompute here
       "KLLM_KV_TIERS_ADAPTIVE_THRESHOLDS": "0",
       "KLLM_KV_TIERS_MIN_REUSE": "2", "KLLM_KV_TIERS_WRITE_ALL_BELOW_PRESSURE": "false"}


def _wait(server: SGLangServer, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 20.0) -> dict[str, Any]:
    return wait_stats(server, pred, timeout_s)


def test_prefix_seen_once_on_each_server_is_shared_through_mooncake() -> None:
    if not mooncake_available():
        pytest.skip("mooncake not installed (pip mooncake-transfer-engine-non-cuda)")
    ref = hf_greedy(tiny_llama_path(), [PROMPT], 6)[0]
    with ExitStack() as stack:
        master = stack.enter_context(mooncake_master())
        # a patient marker check and store calls: two servers on two busy cores must not turn a
        # shared sighting into a local one, or a lookup into a miss, by a timeout (those paths have
        # their own tests against a stalled master)
        args = ARGS + l3_args("kllm_mooncake", master, sightings_timeout_ms=10_000, store_timeout_ms=10_000)
        a, b = (SGLangServer(tiny_llama_path(), plugins=["kv_tiers"], extra_args=args,
                             env={**ENV, "KLLM_KV_TIERS_INSTANCE_ID": name}, startup_timeout_s=300)
                for name in ("A", "B"))
        start_all([a, b])
        for server in (a, b):
            stack.callback(server.stop)

        out = a.generate(input_ids=PROMPT, max_new_tokens=6)
        assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
        # first sighting: the prompt pages are skipped (the page holding the prompt end and the
        # output extends a cached prefix and may be written at once)
        snap_a = _wait(a, lambda s: s["pages_skipped"] >= PAGES)
        assert snap_a["pages_skipped"] >= PAGES and snap_a["pages_admitted"] <= 1, snap_a

        out = b.generate(input_ids=PROMPT, max_new_tokens=6)
        assert out["output_ids"] == ref and out["meta_info"]["cached_tokens"] == 0
        snap_b = _wait(b, lambda s: s["pages_admitted"] >= PAGES)  # B's first sighting, the pages' second
        assert snap_b["pages_admitted"] >= PAGES and snap_b.get("sightings_shared", 0) >= PAGES, snap_b
        assert not snap_b.get("sightings_unshared") and not snap_b["store"]["faults"], snap_b

        assert_loads_from_l3(a, PROMPT, ref, PAGES, 16, 20.0)  # A loads what B wrote
