"""One recorder for benchmark result summaries: `benchmarks/results/<plugin>/<name>.json`.

A summary is a small JSON object with the keys every reader relies on: `command` (what reproduces
it), `commit`, `machine`, `date` (ISO UTC), `metrics` (figures with spread), and optionally
`notes`; a benchmark may add its own keys. `record()` fills `commit`, `date` and `machine` when not
given, rounds floats to six significant digits (far below any run's noise), refuses files over
100 KB, and writes the JSON with short values kept on one line so a summary stays small and
readable. SGLang-free.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Mapping

REQUIRED_KEYS = ("command", "commit", "machine", "date", "metrics")
PLUGINS = ("trace", "incr_prefix", "fair_sched", "kv_tiers", "bigpd_router", "ring_cp", "dspark", "gpu")
MAX_BYTES = 100_000
_INLINE_CHARS = 100


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def results_dir(root: Path | None = None) -> Path:
    return (root or repo_root()) / "benchmarks" / "results"


def result_path(plugin: str, name: str, root: Path | None = None) -> Path:
    """`benchmarks/results/<plugin>/<name>.json`; one-line error on a bad plugin or name."""
    if plugin not in PLUGINS:
        raise ValueError(f"unknown plugin {plugin!r} for a result (one of: {', '.join(PLUGINS)})")
    if not name or "/" in name or name.endswith(".json") or name.startswith("."):
        raise ValueError(f"bad result name {name!r}: a bare name such as 'long' (no folder, no .json)")
    return results_dir(root) / plugin / f"{name}.json"


def git_commit(root: Path | None = None) -> str:
    """The checkout's HEAD (short), with `+dirty` when tracked files differ; without git (the GPU
    machine runs a `git archive`) $KLLM_COMMIT, which the device command sets, else `unknown`."""
    cwd = str(root or repo_root())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KLLM_COMMIT") or "unknown"
    return head + ("+dirty" if dirty else "")


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags that give bf16 matrix math in hardware; without them torch emulates it (the tiny
model, bf16, prefilled about 3x slower than in float32 on such a host)."""


def cpu_model(cpuinfo: str | None = None) -> str:
    """`<model name>, bf16 native|emulated` from /proc/cpuinfo (empty where it cannot be read).
    Lent hosts differ from day to day, and bf16 speed with them."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:64] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name", "")
    if not name:
        return ""
    flags = set(fields.get("flags", "").split())
    return f"{name}, bf16 {'native' if flags & set(BF16_FLAGS) else 'emulated'}"


def machine_description(shared: str | None = None) -> str:
    """`<cores>-core <arch> (<cpu model>, bf16 native|emulated), <os>`, plus what shares it (e.g.
    "shared 2-core, 4 helpers")."""
    cpu = cpu_model()
    text = f"{os.cpu_count()}-core {platform.machine()}{f' ({cpu})' if cpu else ''}, {platform.system()}"
    return f"{text}; {shared}" if shared else text


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def round_floats(value: Any, digits: int = 6) -> Any:
    """`value` with every float rounded to `digits` significant digits (NaN/inf become None)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, Mapping):
        return {str(k): round_floats(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [round_floats(v, digits) for v in value]
    return value


def dumps(value: Any, indent: int = 1) -> str:
    """JSON with any value whose one-line form is short kept on one line; the rest indented."""
    def walk(v: Any, level: int) -> str:
        flat = json.dumps(v, separators=(", ", ": "), ensure_ascii=False)
        if len(flat) <= _INLINE_CHARS or not isinstance(v, (dict, list)) or not v:
            return flat
        pad, inner = " " * (indent * level), " " * (indent * (level + 1))
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {walk(x, level + 1)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        items = [inner + walk(x, level + 1) for x in v]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return walk(value, 0) + "\n"


def check_summary(summary: Mapping[str, Any]) -> None:
    """One-line ValueError when a summary lacks a required key."""
    missing = [k for k in REQUIRED_KEYS if k not in summary]
    if missing:
        raise ValueError(f"result summary lacks {', '.join(missing)} (needs {', '.join(REQUIRED_KEYS)})")


def build_summary(command: str, metrics: Mapping[str, Any], *, machine: str | None = None,
                  shared: str | None = None, commit: str | None = None, date: str | None = None,
                  notes: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": command,
        "commit": commit or git_commit(),
        "machine": machine or machine_description(shared),
        "date": date or utc_now(),
        "metrics": dict(metrics),
    }
    if notes:
        out["notes"] = notes
    out.update(extra)
    return out


def write_summary(path: Path | str, summary: Mapping[str, Any], max_bytes: int = MAX_BYTES) -> Path:
    """Write `summary` (checked, floats rounded) to `path`; ValueError when over `max_bytes`."""
    check_summary(summary)
    text = dumps(round_floats(summary))
    if len(text.encode()) > max_bytes:
        raise ValueError(f"result summary {path} would be {len(text.encode())} bytes (limit {max_bytes}): "
                         f"keep per-request data out of it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def record(plugin: str, name: str, command: str, metrics: Mapping[str, Any], *, root: Path | None = None,
           **fields: Any) -> Path:
    """Build and write `benchmarks/results/<plugin>/<name>.json`; returns its path."""
    return write_summary(result_path(plugin, name, root), build_summary(command, metrics, **fields))


def update_sections(path: Path | str, command_key: str, command: str, sections: Mapping[str, Any],
                    metrics: Any = None, **fields: Any) -> Path:
    """Update a combined summary that several commands write (one section each), keeping the rest.

    `sections` replace those keys of the file; `commands[command_key]` becomes `command` and
    `command` the joined commands (sorted by key); `provenance[command_key]` records this run's
    commit, date and machine, which also become the file's; `metrics[command_key]` becomes
    `metrics` when given. `fields` go to `build_summary` (e.g. `shared=`). Returns the path."""
    path = Path(path)
    data: dict[str, Any] = load_summary(path) if path.exists() else {}
    commands = dict(data.get("commands") or {})
    commands[command_key] = command
    all_metrics = dict(data.get("metrics") or {})
    if metrics is not None:
        all_metrics[command_key] = metrics
    fresh = build_summary(" && ".join(commands[k] for k in sorted(commands)), all_metrics, **fields)
    earlier = data.get("provenance")
    provenance = dict(earlier) if isinstance(earlier, dict) else ({"earlier": earlier} if earlier else {})
    provenance[command_key] = {k: fresh[k] for k in ("commit", "date", "machine")}
    return write_summary(path, {**data, **dict(sections), **fresh, "commands": commands, "provenance": provenance})


def load_summary(path: Path | str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a result summary is a JSON object, not {type(data).__name__}")
    return data
