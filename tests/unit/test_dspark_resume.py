"""Training state on disk and resume: what a fresh GPU machine needs to continue a run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kllm_plugins.plugins.dspark.core.drafters import build_drafter
from kllm_plugins.plugins.dspark.training.train_state import check_train_state, load_train_state, save_train_state
from kllm_plugins.plugins.dspark.training.trainer import TrainConfig, TrainState, train_drafter

sys.path.insert(0, str(Path(__file__).parent))
from test_dspark_spec_loop import drafter_for, random_target  # noqa: E402


def _seqs(n: int = 24) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = [int(torch.randint(0, 32, (1,), generator=g))]
        for _ in range(30):
            x.append((x[-1] * 5 + 3) % 32)
        out.append((x, 6))
    return out


def _model(target, kind: str = "dspark"):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    return build_drafter(drafter_for(target, kind, gamma=3).cfg).float()


def test_state_round_trip_in_parts_and_mixed_snapshots_detected(tmp_path: Path) -> None:
    target = random_target(32, seed=2, dtype=torch.float32)
    model = _model(target)
    st = TrainState(step=7, train_seconds=3.5, progress=0.25, curve=[{"progress": 0.25, "val": 1.5}], history=[],
                    best_score=1.5, best_is_current=True)
    files = save_train_state(tmp_path / "s", model, st, part_bytes=6_000)
    assert len(files) > 1 and all(f.stat().st_size < 20_000 for f in files)
    other = _model(target)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    got, best = load_train_state(tmp_path / "s", other)
    assert best is None and got.step == 7 and got.curve == st.curve
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-2, rtol=1e-2), k  # bf16 on disk
    # a part of another snapshot in the folder is detected
    save_train_state(tmp_path / "t", model, TrainState(**{**st.to_dict(), "step": 9, "best_score": 1.5}), part_bytes=6_000)
    (tmp_path / "s" / "part_0.pt").write_bytes((tmp_path / "t" / "part_0.pt").read_bytes())
    with pytest.raises(ValueError):
        check_train_state(tmp_path / "s")


def test_resume_continues_step_clock_curve_and_keeps_the_best(tmp_path: Path) -> None:
    """A run cut after its 50% evaluation and resumed in a new drafter object (as on a fresh
    machine) continues at the saved step and evaluation points, ends at the step budget, and
    the best weights are those of the best evaluation across both parts."""
    target = random_target(32, seed=2, dtype=torch.float32)
    seqs = _seqs()
    cfg = TrainConfig(steps=40, batch_size=4, anchors_per_seq=4, lr=1e-2, warmup=5, log_every=10,
                      eval_at=(0.25, 0.5, 0.75, 1.0))
    scores = iter([1.0, 3.0, 2.0, 1.5, 0.5, 9.0])  # 25%, 50% | 75%, 100% after the resume
    saved: list[TrainState] = []

    class Cut(Exception):
        pass

    def snap(st: TrainState) -> None:
        save_train_state(tmp_path / "state", model, st)
        saved.append(st)
        if st.progress >= 0.5:
            raise Cut  # the machine is lost right after the 50% snapshot

    model = _model(target)
    with pytest.raises(Cut):
        train_drafter(target, model, seqs, cfg, evaluate=lambda m: next(scores), snapshot=snap)
    assert [s.step for s in saved] == [10, 20] and saved[-1].best_is_current
    fresh = _model(target)
    state, best = load_train_state(tmp_path / "state", fresh)
    assert state.step == 20 and best is None
    curve: list = []
    seen_steps: list[int] = []
    vals = iter([2.0, 1.5])

    def evaluate(m: torch.nn.Module) -> float:
        return next(vals)

    def snap2(st: TrainState) -> None:
        seen_steps.append(st.step)
        if not st.best_is_current:
            assert st.best_weights is not None  # the 50% weights travel with a later snapshot
            save_train_state(tmp_path / "state2", fresh, st)

    w50 = {k: v.clone() for k, v in fresh.state_dict().items()}
    hist = train_drafter(target, fresh, seqs, cfg, evaluate=evaluate, curve=curve, snapshot=snap2, resume=state)
    assert [c["progress"] for c in curve] == [0.25, 0.5, 0.75, 1.0]
    assert [c["val"] for c in curve] == [1.0, 3.0, 2.0, 1.5]
    assert seen_steps[0] == 30 and seen_steps[-1] == 40
    assert max(h["step"] for h in hist) == 39 and min(h["step"] for h in hist) == 0  # history carried over
    for k, v in fresh.state_dict().items():  # kept best = the 50% weights (loaded, bf16-rounded)
        assert torch.equal(v, w50[k]), k
    # a state whose best is an earlier evaluation carries those weights and restores them
    third = _model(target)
    st3, best3 = load_train_state(tmp_path / "state2", third)
    assert not st3.best_is_current and best3 is not None
    for k, v in best3.items():
        assert torch.allclose(v, w50[k], atol=1e-2, rtol=1e-2), k
