"""Synthetic shared-prefix, multi-turn trace in the harness's one trace format (Mooncake JSONL,
`kllm_plugins.bench.trace`; `sglang.bench_serving --dataset-name mooncake` reads it too).

Each request: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [block ids]}.
Block ids are chained prefix blocks of `BLOCK` tokens: two requests share a block id only when
they share every token up to the end of that block (as in Mooncake's traces, whose block is 512
tokens; here it is the KV page size). Token ids come from the harness (`request_tokens`, i.e.
`trace.token_ids` with this block size; `tokens_for` for a bare list of block ids), deterministic
per block id, so a replay sends identical tokens for identical blocks.

Shape: `groups` system prompts of `system_blocks` blocks; `sessions` conversations, each under one
system prompt, each of `turns` turns; every turn appends `user_blocks` new blocks and the previous
answer's blocks. Sessions are interleaved round-robin, so between two turns of one conversation
every other conversation runs once: with enough sessions the conversation's KV has left L1 (and
L2) by the time it comes back, which is where L3 pays. `--unique` makes every request share
nothing (the no-reuse control).
"""
from __future__ import annotations

import argparse
import json
import random
from typing import Any, Iterator, Mapping

from kllm_plugins.bench import trace

BLOCK = 16  # tokens per block id: the KV page size of the benchmark servers
# token ids drawn in [LOW, VOCAB): inside the tiny model's 4096-token vocabulary, clear of its specials
LOW, VOCAB = 100, 3996


def records(sessions: int = 12, turns: int = 3, groups: int = 3, system_blocks: int = 8, user_blocks: int = 4,
            answer_blocks: int = 2, output_length: int = 4, block_size: int = BLOCK, interval_ms: int = 500,
            unique: bool = False, seed: int = 0) -> list[trace.TraceRecord]:
    """The trace as harness records (`kllm_plugins.bench.trace.TraceRecord`)."""
    return [trace.parse_record(r, f"request {i}") for i, r in enumerate(generate(
        sessions, turns, groups, system_blocks, user_blocks, answer_blocks, output_length, block_size,
        interval_ms, unique, seed))]


def generate(sessions: int = 12, turns: int = 3, groups: int = 3, system_blocks: int = 8, user_blocks: int = 4,
             answer_blocks: int = 2, output_length: int = 4, block_size: int = BLOCK, interval_ms: int = 500,
             unique: bool = False, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The trace's Mooncake records as JSON objects (what one line of the file holds)."""
    rng = random.Random(seed)
    next_id = [0]

    def fresh(n: int) -> list[int]:
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    systems = [fresh(system_blocks) for _ in range(groups)]
    history = [list(systems[rng.randrange(groups)]) for _ in range(sessions)]
    t = 0
    for turn in range(turns):
        for s in range(sessions):
            if unique:
                ids = fresh(len(history[s]) + user_blocks)
            else:
                history[s] += fresh(user_blocks)
                ids = list(history[s])
            yield {"timestamp": t, "input_length": len(ids) * block_size, "output_length": output_length,
                   "hash_ids": ids}
            if not unique:
                history[s] += fresh(answer_blocks)
            t += interval_ms


def tokens_for(hash_ids: list[int], block_size: int = BLOCK) -> list[int]:
    """Token ids of a list of block ids: each block's tokens from the harness (`trace.block_tokens`)."""
    out: list[int] = []
    for b in hash_ids:
        out += trace.block_tokens(b, block_size, VOCAB, LOW)
    return out


def request_tokens(record: Mapping[str, Any] | trace.TraceRecord, offset: int = 0) -> list[int]:
    """Prompt token ids of one Mooncake record (a JSON object or a harness record), every block id
    shifted by `offset` (a cell's own token space): `trace.token_ids` at this benchmark's block size."""
    rec = record if isinstance(record, trace.TraceRecord) else trace.parse_record(dict(record))
    return trace.token_ids(rec, BLOCK, VOCAB, offset, LOW)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--unique", action="store_true")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    recs = records(a.sessions, a.turns, unique=a.unique)
    if a.out == "-":
        print("\n".join(json.dumps(r.to_json()) for r in recs))
    else:
        trace.write_trace(a.out, recs)


if __name__ == "__main__":
    main()
