"""Layer: plugin tooling (no SGLang import). A drafter's training state on disk, in parts small
enough to travel (the GPU machine returns files of at most 16 MiB and a call carries 64 MiB).

`save_train_state` writes the weights (bf16 by default: half the bytes of the fp32 master
weights, which a resume then continues from rounded) and, when the best evaluation is not the
current one, the best weights, split over `part_<i>.pt` files of at most `part_bytes`; every part
holds the `TrainState` (JSON) and the snapshot's step, so a folder mixing two snapshots is
detected (`check_train_state`). The folder is replaced atomically (write beside, then rename).
The optimizer state is not saved (see `trainer.py`: a resume re-warms a fresh AdamW).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from kllm_plugins.plugins.dspark.training.trainer import TrainState

PART_BYTES = 15 * 1024 * 1024


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()


def save_train_state(folder: Path, model: nn.Module, state: TrainState, *, dtype: torch.dtype = torch.bfloat16,
                     part_bytes: int = PART_BYTES) -> list[Path]:
    folder = Path(folder)
    tensors = {f"w.{k}": _cast(v, dtype) for k, v in model.state_dict().items()}
    if not state.best_is_current and state.best_weights is not None:
        tensors.update({f"best.{k}": _cast(v, dtype) for k, v in state.best_weights.items()})
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if n > part_bytes:
            raise ValueError(f"tensor {k} ({n} bytes) exceeds a part ({part_bytes} bytes)")
        if size + n > part_bytes and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][k] = v
        size += n
    meta = json.dumps(state.to_dict())
    tmp = folder.with_name(folder.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, p in enumerate(parts):
        torch.save({"meta": meta, "step": state.step, "part": i, "parts": len(parts), "tensors": p}, tmp / f"part_{i}.pt")
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return sorted(folder.glob("part_*.pt"))


def _read(folder: Path) -> list[dict]:
    files = sorted(Path(folder).glob("part_*.pt"))
    if not files:
        raise FileNotFoundError(f"{folder}: no part_*.pt")
    data = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    n, steps = {d["parts"] for d in data}, {d["step"] for d in data}
    if len(n) != 1 or len(steps) != 1 or sorted(d["part"] for d in data) != list(range(next(iter(n)))):
        raise ValueError(f"{folder}: parts of different snapshots or a part missing ({[f.name for f in files]})")
    return data


def check_train_state(folder: Path) -> TrainState:
    """The snapshot's state; raises when parts are missing or come from different snapshots."""
    return TrainState.from_dict(json.loads(_read(folder)[0]["meta"]))


def load_train_state(folder: Path, model: nn.Module) -> tuple[TrainState, dict[str, torch.Tensor] | None]:
    """Loads the snapshot's weights into `model` (its dtype/device kept); returns the state and the
    best weights when they differ from the current ones."""
    data = _read(folder)
    state = TrainState.from_dict(json.loads(data[0]["meta"]))
    tensors: dict[str, torch.Tensor] = {}
    for d in data:
        tensors.update(d["tensors"])
    own = model.state_dict()
    current = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
    if set(current) != set(own):
        raise ValueError(f"{folder}: weights do not match the drafter ({sorted(set(current) ^ set(own))[:4]} ...)")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in current.items()})
    best = {k[5:]: v.to(own[k[5:]].device, own[k[5:]].dtype) for k, v in tensors.items() if k.startswith("best.")}
    return state, (best or None)
