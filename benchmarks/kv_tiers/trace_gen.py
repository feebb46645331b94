"""Synthetic shared-prefix, multi-turn trace in the Mooncake trace format (one JSON object a line).

Each request: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [block ids]}.
Block ids are chained prefix blocks of `block_size` tokens: two requests share a block id only when
they share every token up to the end of that block (as in Mooncake's traces, whose block is 512
tokens; here it is the KV page size). `tokens_for` turns block ids back into token ids
deterministically, so a replay sends identical tokens for identical blocks.

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
from typing import Iterator


def generate(sessions: int = 12, turns: int = 3, groups: int = 3, system_blocks: int = 8, user_blocks: int = 4,
             answer_blocks: int = 2, output_length: int = 4, block_size: int = 16, interval_ms: int = 500,
             unique: bool = False, seed: int = 0) -> Iterator[dict[str, object]]:
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


def tokens_for(hash_ids: list[int], block_size: int = 16, vocab: int = 4096) -> list[int]:
    out: list[int] = []
    for b in hash_ids:
        r = random.Random(1_000_003 * b + 17)
        out += [r.randrange(100, vocab - 100) for _ in range(block_size)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--unique", action="store_true")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    lines = [json.dumps(r) for r in generate(a.sessions, a.turns, unique=a.unique)]
    if a.out == "-":
        print("\n".join(lines))
    else:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
