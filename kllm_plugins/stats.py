"""Layer: host core (no SGLang import). Snapshots that plugins publish from SGLang's
subprocesses and the launcher serves at `GET /kllm/stats`.

Each process writes `<run_dir>/<plugin>.<pid>.json` atomically (write then rename), so a
reader never sees a torn file. Writing is rate-limited while busy and flushed when idle.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from kllm_plugins import runtime


class StatsWriter:
    def __init__(self, plugin: str, interval_s: float, run_dir: str | None = None) -> None:
        self.plugin = plugin
        self.interval_s = interval_s
        self.path = os.path.join(run_dir or runtime.run_dir(), f"{plugin}.{os.getpid()}.json")
        self.dirty = False
        self._last = float("-inf")
        self.writes = 0

    def update(self, snapshot: Callable[[], dict[str, Any]], changed: bool) -> None:
        """Note a pass; write `snapshot()` now if due. The snapshot is built only when written,
        so calling this on every scheduler pass costs a comparison, not a dict.

        changed=True (busy): written at most once per interval. changed=False (idle): pending
        changes are written at once, nothing is written when nothing changed.
        """
        if changed:
            self.dirty = True
        if not self.dirty:
            return
        now = time.monotonic()
        if changed and now - self._last < self.interval_s:
            return
        self.write(snapshot())
        self._last = now

    def write(self, snapshot: dict[str, Any]) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "time": time.time(), "data": snapshot}, fh)
        os.replace(tmp, self.path)
        self.dirty = False
        self.writes += 1


def read_all(run_dir: str | None = None) -> dict[str, Any]:
    """Every plugin's snapshots by pid, plus `total`: numeric fields summed over processes."""
    folder = run_dir or runtime.run_dir()
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        plugin, _, rest = name.partition(".")
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        entry = out.setdefault(plugin, {"processes": {}, "total": {}})
        entry["processes"][str(record.get("pid", rest))] = record.get("data", {})
        for key, value in record.get("data", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                entry["total"][key] = entry["total"].get(key, 0) + value
    return out
