"""Training data from every ShareGPT turn: conversation messages, ChatML segments equal the chat
template, windows fit the cap and start at a user turn, the compact prompt file round-trips."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kllm_plugins.plugins.dspark.training.data import ChatMLSegments, TokenizedPrompts, turn_prompts
from kllm_plugins.plugins.dspark.training.sharegpt import conversation_messages

SPECIAL = ("<|im_start|>", "<|im_end|>")
SYSTEM = "<|im_start|>system\nYou are a test assistant<|im_end|>\n"


class CharChatML:
    """A stand-in tokenizer: one id per character, one per special token; SmolLM2's ChatML template."""

    def _ids(self, text: str) -> list[int]:
        out: list[int] = []
        for part in re.split("(<\\|im_start\\|>|<\\|im_end\\|>)", text):
            if part in SPECIAL:
                out.append(1 + SPECIAL.index(part))
            else:
                out.extend(10 + ord(c) for c in part)
        return out

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self._ids(text)}

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False):
        text = "" if messages and messages[0]["role"] == "system" else SYSTEM
        text += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self._ids(text) if tokenize else text


def conv(*turns: str) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def test_segments_equal_the_chat_template() -> None:
    tok = CharChatML()
    seg = ChatMLSegments(tok)
    windows = [conv("hello there"), conv("a question", "an answer", "a follow-up"), conv("x" * 50, "y", "z" * 9)]
    assert seg.check(windows) == 0
    seg.system = seg.system[1:]  # a broken prefix is noticed
    assert seg.check(windows) == len(windows)


def test_every_user_turn_is_a_prompt_with_the_context_that_fits() -> None:
    tok = CharChatML()
    seg = ChatMLSegments(tok)
    c = conv("first question", "first answer " * 3, "second question", "second answer", "third question", "ok", "short")
    cap = 160
    prompts = turn_prompts(seg, c, cap, min_chars=8)
    assert [t for t, _ in prompts] == [0, 2, 4]  # "short" has 5 characters: skipped
    for t, ids in prompts:
        assert len(ids) <= cap
        text = "".join(chr(i - 10) if i >= 10 else SPECIAL[i - 1] for i in ids)
        assert text.startswith(SYSTEM + "<|im_start|>user\n") and text.endswith(
            f"<|im_start|>user\n{c[t]['content']}<|im_end|>\n<|im_start|>assistant\n")
        # the context is the longest run of earlier (user, assistant) pairs that fits the cap
        start = text.count("<|im_start|>user") - 1
        kept = c[t - 2 * start: t + 1]
        assert ids == tok.apply_chat_template(kept, add_generation_prompt=True)
        if t - 2 * start >= 2:
            longer = c[t - 2 * start - 2: t + 1]
            assert len(tok.apply_chat_template(longer, add_generation_prompt=True)) > cap
    # the third turn keeps the second pair: system, user, assistant, user and the generation prompt
    assert prompts[2][1].count(1) == 5


def test_a_user_turn_longer_than_the_cap_keeps_its_head() -> None:
    seg = ChatMLSegments(CharChatML())
    (t, ids), = turn_prompts(seg, conv("abcdefghij" * 30), 120)
    assert t == 0 and len(ids) <= 120
    text = "".join(chr(i - 10) if i >= 10 else SPECIAL[i - 1] for i in ids)
    assert "<|im_start|>user\nabcdefghij" in text and text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_conversation_messages_merge_skip_and_allow_an_assistant_start(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "gpt", "value": "a1 cont"}, {"from": "system", "value": "s"},
                           {"from": "human", "value": "q2"}]},
        {"conversations": [{"from": "gpt", "value": "tail of an answer"}, {"from": "human", "value": "q3"}]},
    ]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    got = list(conversation_messages(f))
    assert got[0] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1\n\na1 cont"},
                      {"role": "user", "content": "q2"}]
    assert got[1] == [{"role": "assistant", "content": "tail of an answer"}, {"role": "user", "content": "q3"}]


def test_compact_prompt_file_round_trips_and_reads_the_old_format(tmp_path: Path) -> None:
    p = TokenizedPrompts([[1, 2, 3], [4]], [[5, 6]], [[7]], 2, "test", [[8, 9], []])
    p.save(tmp_path / "new.pt")
    assert TokenizedPrompts.load(tmp_path / "new.pt") == p
    torch.save({"train": [[1]], "calib": [[2]], "test": [[3]], "eos_id": 0, "source": "old"}, tmp_path / "old.pt")
    old = TokenizedPrompts.load(tmp_path / "old.pt")
    assert old.train == [[1]] and old.val == []


def test_answers_travel_back_without_their_prompts(tmp_path: Path) -> None:
    from kllm_plugins.plugins.dspark.training.data import load_answers_for, save_answers

    prompts = {"train": [[1, 2], [3, 4, 5]], "val": [[6]]}
    seqs = {"train": [([1, 2, 9, 9, 2], 2), ([3, 4, 5, 7], 3)], "val": [([6, 8, 2], 1)]}
    save_answers(tmp_path / "a.xz", seqs)
    assert load_answers_for(tmp_path / "a.xz", prompts) == seqs
    try:
        load_answers_for(tmp_path / "a.xz", {"train": [[1, 2]], "val": [[6]]})
    except ValueError as e:
        assert "1 train prompts" in str(e)
    else:
        raise AssertionError("a prompt file of another size must be refused")
