"""Write `mooncake_small.jsonl`: a small trace in the Mooncake FAST'25 trace format (one JSON object a
line: `timestamp` in ms, `input_length`, `output_length`, `hash_ids` of 512-token blocks; blocks
shared between requests are shared prefixes), generated here with a fixed seed, not taken from the
published traces. Sized for a CPU: 8 requests over 1.5 s, one to three blocks each (SGLang's
bench_serving turns each block id into about 130 prompt tokens), 4 output tokens.

    python tests/conformance/data/make_mooncake_trace.py  # rewrites the file beside this script
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 28
N = 8


def records(seed: int = SEED, n: int = N) -> list[dict[str, int | list[int]]]:
    rng = random.Random(seed)
    shared = [0, 1]  # two popular prefix blocks
    out = []
    next_block = 2
    for i in range(n):
        blocks = [rng.choice(shared)] if rng.random() < 0.75 else []
        for _ in range(rng.randint(1, 3 - len(blocks))):
            blocks.append(next_block)
            next_block += 1
        out.append({"timestamp": i * 200 + rng.randint(0, 50), "input_length": 512 * len(blocks),
                    "output_length": 4, "hash_ids": blocks})
    return out


def main() -> None:
    path = Path(__file__).with_name("mooncake_small.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))


if __name__ == "__main__":
    main()
