"""One trace format for the benchmarks: Mooncake JSONL, the format `sglang.bench_serving
--dataset-name mooncake --dataset-path FILE` reads. SGLang-free.

One JSON object per line: `timestamp` (ms since the trace start), `input_length` (tokens),
`output_length` (tokens) and `hash_ids` (one id per block of `BLOCK_TOKENS` prompt tokens; two
requests with the same leading ids share that prefix). Extra keys (for example `session`, `turn`)
are kept. `.gz` files are read and written compressed.

`token_ids()` turns a record into prompt token ids deterministically (each block id maps to the same
tokens everywhere), so a replay against `/generate` reproduces the trace's prefix sharing.
"""
from __future__ import annotations

import gzip
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

BLOCK_TOKENS = 512  # Mooncake's block size
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRecord:
    timestamp: float  # ms from the trace start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        ts: float | int = int(self.timestamp) if float(self.timestamp).is_integer() else self.timestamp
        out: dict[str, Any] = {"timestamp": ts, "input_length": self.input_length,
                               "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        out.update(self.extra)
        return out

    @property
    def arrival_s(self) -> float:
        return self.timestamp / 1000.0


def parse_record(obj: Any, where: str = "record") -> TraceRecord:
    """A TraceRecord from one decoded JSON line; one-line ValueError naming what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a Mooncake trace line is a JSON object, not {type(obj).__name__}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (a Mooncake record has {', '.join(FIELDS)})")
    ts, inp, outp, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    for name, v in (("input_length", inp), ("output_length", outp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    extra = {k: v for k, v in obj.items() if k not in FIELDS}
    return TraceRecord(float(ts), inp, outp, tuple(ids), extra)


def _open_text(path: Path, mode: str) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")  # type: ignore[return-value]


def iter_trace(path: Path | str) -> Iterator[TraceRecord]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {path}")
    with _open_text(path, "r") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            yield parse_record(obj, f"{path}:{n}")


def read_trace(path: Path | str, limit: int | None = None) -> list[TraceRecord]:
    out = []
    for rec in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(rec)
    return out


def write_trace(path: Path | str, records: Iterable[TraceRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), separators=(", ", ": ")) + "\n")
    return path


def block_tokens(block_id: int, block_size: int = BLOCK_TOKENS, vocab: int = 4000, low: int = 5) -> list[int]:
    """The `block_size` token ids of one block: seeded by the id, the same in every process."""
    rng = random.Random(0x6B6C6C6D ^ (block_id * 2654435761 % (1 << 32)))
    return [low + rng.randrange(vocab - low) for _ in range(block_size)]


def token_ids(record: TraceRecord, block_size: int = BLOCK_TOKENS, vocab: int = 4000, offset: int = 0,
              low: int = 5) -> list[int]:
    """Prompt token ids of a record: its blocks' tokens (ids in [low, vocab)), cut or padded (last
    block's pattern) to `input_length`. `offset` shifts every block id (a separate token space per
    cell or repeat)."""
    ids: list[int] = []
    for h in record.hash_ids:
        ids.extend(block_tokens(h + offset, block_size, vocab, low))
    n = record.input_length
    if len(ids) >= n:
        return ids[:n]
    pad = block_tokens((1 << 40) + len(record.hash_ids) + offset, block_size, vocab, low)
    while len(ids) < n:
        ids.extend(pad[: n - len(ids)])
    return ids


def retime(records: Iterable[TraceRecord], arrivals_s: Iterable[float]) -> list[TraceRecord]:
    """The records with timestamps from an arrival schedule (seconds)."""
    return [TraceRecord(round(t * 1000.0, 3), r.input_length, r.output_length, r.hash_ids, dict(r.extra))
            for r, t in zip(records, arrivals_s)]
