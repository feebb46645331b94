"""Benchmark helper (GPU machine): copy the drafters' training states to $OUT within a file budget.

A call returns at most 8 files of 16 MiB; a drafter's state is 2 parts (bf16). Each call copies
the states whose latest snapshot has not come back yet, those returned longest ago first, as
many whole states as `--slots` files allow, checking that a state's parts belong to one snapshot
(a trainer may be rewriting it). `<work>/returned_states.json` records what came back.

    python3 collect_states.py --work /tmp/dsp --out $OUT --slots 5
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from kllm_plugins.plugins.dspark.training.train_state import check_train_state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", type=int, required=True)
    a = ap.parse_args()
    rec_path = a.work / "returned_states.json"
    returned = json.loads(rec_path.read_text()) if rec_path.exists() else {}
    todo = []
    for d in sorted(a.work.glob("state_*")):
        if not d.is_dir() or d.name.endswith((".new", ".old")):
            continue
        try:
            st = check_train_state(d)
        except (ValueError, FileNotFoundError, RuntimeError, EOFError) as e:
            print("STATES skip", d.name, e)
            continue
        last = returned.get(d.name, {"step": -1, "order": -1})
        if st.step != last["step"]:
            todo.append((last["order"], d, st))
    order = max([r["order"] for r in returned.values()], default=0) + 1
    slots = a.slots
    for _, d, st in sorted(todo, key=lambda x: x[0]):
        parts = sorted(d.glob("part_*.pt"))
        if len(parts) > slots:
            continue
        dst = a.out / d.name
        dst.mkdir(parents=True, exist_ok=True)
        for p in parts:
            shutil.copy2(p, dst / p.name)
        try:  # the trainer may have replaced the folder while we copied
            ok = check_train_state(dst).step == st.step
        except (ValueError, RuntimeError, EOFError):
            ok = False
        if not ok:
            shutil.rmtree(dst)
            print("STATES changed while copying", d.name)
            continue
        slots -= len(parts)
        returned[d.name] = {"step": st.step, "order": order, "done": st.done}
        order += 1
        print("STATES returned", d.name, json.dumps({"step": st.step, "progress": round(st.progress, 4), "done": st.done}))
    rec_path.write_text(json.dumps(returned))
    print("STATES", json.dumps({"returned_so_far": returned, "slots_left": slots}))


if __name__ == "__main__":
    main()
