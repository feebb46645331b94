"""ring_cp against real SGLang 0.5.23 code on CPU: patch targets resolve, the AROUND hook installs
RingCPStrategy, and our zigzag layout equals SGLang's ZigzagCPStrategy metadata."""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

pytestmark = pytest.mark.sglang

os.environ.setdefault("SGLANG_PLATFORM", "kllm_cpu")


@pytest.fixture()
def ring_config() -> Iterator[None]:
    from kllm_plugins import runtime
    from kllm_plugins.plugins.ring_cp.config import RingCPConfig

    runtime.set_config("ring_cp", RingCPConfig(chunks_per_shard=2))
    yield
    runtime.clear()


def test_patch_targets_and_impls_resolve() -> None:
    pytest.importorskip("sglang")
    from kllm_plugins.attach import resolve_impl, resolve_target
    from kllm_plugins.plugins.ring_cp.hookimpls import kllm_declare

    spec = kllm_declare()
    assert spec.patches
    for patch in spec.patches:
        assert callable(resolve_target(patch.target)), patch.target
        assert callable(resolve_impl(patch.impl)), patch.impl


def test_around_init_cp_strategy_installs_ring(ring_config: None) -> None:
    pytest.importorskip("sglang")
    import sglang.srt.layers.cp.base as base
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    from kllm_plugins.plugins.ring_cp.sglang_adapter import around_init_cp_strategy, ring_strategy_class

    saved = base._STRATEGY
    try:
        around_init_cp_strategy(base.init_cp_strategy, enable_prefill_cp=True, cp_size=2, cp_strategy="zigzag")
        strat = base._STRATEGY
        assert isinstance(strat, ring_strategy_class()) and isinstance(strat, ZigzagCPStrategy)
        assert strat.cp_size == 2 and strat.chunks_per_shard == 2
        around_init_cp_strategy(base.init_cp_strategy, enable_prefill_cp=False, cp_size=2, cp_strategy="zigzag")
        assert base._STRATEGY is None  # CP off stays off
        around_init_cp_strategy(base.init_cp_strategy, enable_prefill_cp=True, cp_size=2, cp_strategy="interleave")
        assert not isinstance(base._STRATEGY, ring_strategy_class())  # only zigzag is replaced
    finally:
        base._STRATEGY = saved


@pytest.mark.parametrize("cp_size", [2, 3])
def test_layout_matches_sglang_zigzag_metadata(cp_size: int) -> None:
    pytest.importorskip("sglang")
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    from kllm_plugins.plugins.ring_cp.core import ShardPlan
    from kllm_plugins.plugins.ring_cp.core.sglang_layout import sglang_to_plan, sglang_zigzag_order
    from kllm_plugins.plugins.ring_cp.sglang_adapter import _seq_lens

    seq_lens = [53, 20, 31]
    for rank in range(cp_size):
        class AtRank(ZigzagCPStrategy):
            @property
            def cp_rank(self) -> int:
                return rank

        strat = AtRank(cp_size=cp_size)
        meta = strat.build_metadata(sum(seq_lens), None, seq_lens)
        tokens = torch.arange(sum(seq_lens))
        chunks = torch.split(tokens, meta.split_list)
        sglang_local = torch.cat([chunks[i] for i in meta.zigzag_index])
        assert torch.equal(sglang_local, sglang_zigzag_order(seq_lens, cp_size, rank))
        assert _seq_lens(meta, cp_size) == seq_lens
        plan = ShardPlan.build(seq_lens, cp_size, "zigzag")
        assert torch.equal(sglang_local[sglang_to_plan(seq_lens, cp_size, rank)], plan.global_index(rank))
        # kv_len_prev/next (the all-gather baseline's key prefixes) are our segments' ends.
        ends = [s.end for s in plan.segments[rank]]
        assert sorted(meta.kv_len_prev_list + meta.kv_len_next_list) == sorted(ends)


def test_ring_strategy_run_attention_over_gloo(tmp_path: object) -> None:
    """Two ranks: SGLang's zigzag local order in, ring attention, SGLang's order out == full attention."""
    pytest.importorskip("sglang")
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent))
    from ring_cp_strategy_cases import run

    tmp = Path(str(tmp_path))
    try:
        mp.spawn(run, args=(2, str(tmp / "pg"), str(tmp)), nprocs=2, join=True)
    except Exception as exc:
        errs = "".join(p.read_text() for p in sorted(tmp.glob("rank*.err")))
        raise AssertionError(errs or str(exc)) from exc


def test_hook_attaches_through_sglangs_hook_registry() -> None:
    """In a fresh process: the host registers the AROUND hook with SGLang's real HookRegistry,
    verifies it, and SGLang's own init_cp_strategy / get_cp_strategy then yield RingCPStrategy."""
    pytest.importorskip("sglang")
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        from kllm_plugins.manager import KllmPluginManager
        from kllm_plugins.sglang_bridge import Host
        from kllm_plugins.plugins.ring_cp import hookimpls
        h = Host(KllmPluginManager(extra_plugins=[("ring_cp", hookimpls)], load_entry_points=False))
        h.enable(["ring_cp"])
        rep = h.reports[-1]
        assert not rep.failures and len(rep.results) == 1, rep.results
        import sglang.srt.layers.cp.base as base
        from kllm_plugins.plugins.ring_cp.sglang_adapter import ring_strategy_class
        base.init_cp_strategy(enable_prefill_cp=True, cp_size=4, cp_strategy="zigzag")
        s = base._STRATEGY
        assert isinstance(s, ring_strategy_class()) and s.cp_size == 4 and s.chunks_per_shard == 3, s
        print("RING_OK", type(s).__name__, s.name)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLLM_")}
    env.update({"KLLM_STRICT": "1", "KLLM_RING_CP_CHUNKS_PER_SHARD": "3", "SGLANG_PLATFORM": "kllm_cpu"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RING_OK RingCPStrategy kllm_ring" in out.stdout
