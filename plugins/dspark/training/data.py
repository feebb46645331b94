"""Layer: plugin tooling (no SGLang import). Training data: prompts, the target's own answers, batches.

The drafter learns to predict the target, so the training text is the target's own answer to
each prompt (prompt tokens are context only): greedy, or sampled at a temperature (`generate_answers`). `TokenizedPrompts` is what travels to a machine
without a tokenizer (flat int32 token arrays, xz-compressed: the ~60K multi-turn prompts share
most of their context with their conversation's earlier prompts); `generate_answers` runs there
with the reference Llama. `turn_prompts` makes a prompt of every user turn of a conversation, with
as many earlier turns as fit the length cap.
"""
from __future__ import annotations

import io
import logging
import lzma
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kllm_plugins.plugins.dspark.core.spec_loop import autoregressive_generate
from kllm_plugins.plugins.dspark.core.target_llama import LlamaTarget

logger = logging.getLogger("kllm.dspark")


@dataclass
class TokenizedPrompts:
    train: list[list[int]]
    calib: list[list[int]]
    test: list[list[int]]
    eos_id: int
    source: str

    val: list[list[int]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """xz-compressed flat int32 arrays (`load` also reads the older plain lists)."""
        d: dict[str, Any] = {"eos_id": self.eos_id, "source": self.source, "format": "flat-xz"}
        for split in ("train", "calib", "test", "val"):
            d[split] = pack_lists(getattr(self, split))
        buf = io.BytesIO()
        torch.save(d, buf)
        Path(path).write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))

    @classmethod
    def load(cls, path: Path) -> "TokenizedPrompts":
        raw = Path(path).read_bytes()
        if raw[:6] == b"\xfd7zXZ\x00":
            raw = lzma.decompress(raw)
        d = torch.load(io.BytesIO(raw), weights_only=True)
        if d.get("format") == "flat-xz":
            for split in ("train", "calib", "test", "val"):
                d[split] = unpack_lists(d[split])
        return cls(d["train"], d["calib"], d["test"], int(d["eos_id"]), str(d["source"]), d.get("val", []))


def pack_lists(rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    return {"flat": flat, "lens": torch.tensor([len(r) for r in rows], dtype=torch.int64)}


def unpack_lists(packed: dict[str, torch.Tensor]) -> list[list[int]]:
    return [r.tolist() for r in torch.split(packed["flat"], packed["lens"].tolist())] if packed["lens"].numel() else []


def save_answers(path: Path, splits: dict[str, Sequence[tuple[list[int], int]]],
                 meta: dict[str, float] | None = None) -> None:
    """The answer part of (prompt + answer, prompt length) sequences per split, xz-compressed: what a
    later run needs, beside the prompt file, to skip generation. `meta` (e.g. the sampling
    temperature of the train answers) travels with them (`answers_meta`)."""
    d: dict[str, Any] = {k: pack_lists([s[p:] for s, p in v]) for k, v in splits.items()}
    if meta:
        d["_meta"] = {k: float(v) for k, v in meta.items()}
    buf = io.BytesIO()
    torch.save(d, buf)
    Path(path).write_bytes(lzma.compress(buf.getvalue(), preset=6))


def load_answers_for(path: Path, prompts: dict[str, Sequence[Sequence[int]]]) -> dict[str, list[tuple[list[int], int]]]:
    """`save_answers`' file joined again with the prompts it answered (same splits, same order)."""
    d = torch.load(io.BytesIO(lzma.decompress(Path(path).read_bytes())), weights_only=True)
    d.pop("_meta", None)
    out: dict[str, list[tuple[list[int], int]]] = {}
    for k, packed in d.items():
        answers = unpack_lists(packed)
        if len(answers) != len(prompts[k]):
            raise ValueError(f"{path}: {len(answers)} answers for {len(prompts[k])} {k} prompts")
        out[k] = [(list(p) + a, len(p)) for p, a in zip(prompts[k], answers)]
    return out


def answers_meta(path: Path) -> dict[str, float]:
    """What `save_answers` recorded beside the answers; files without it hold greedy answers."""
    d = torch.load(io.BytesIO(lzma.decompress(Path(path).read_bytes())), weights_only=True)
    return dict(d.get("_meta") or {"train_temperature": 0.0})


class ChatMLSegments:
    """A ChatML template (SmolLM2's) as token segments: default system prefix, one segment per
    message, generation prompt. Concatenating them gives what `apply_chat_template` gives (each
    segment starts at a special token, so no BPE merge crosses a boundary; `check` verifies it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False,
                                              add_generation_prompt=True)
        head = "<|im_start|>user\n@@<|im_end|>\n"
        if head not in probe or not probe.endswith("<|im_start|>assistant\n"):
            raise ValueError("not a ChatML chat template")
        self.system = self.ids(probe[: probe.index(head)])
        self.gen = self.ids("<|im_start|>assistant\n")
        self.tail = self.ids("<|im_end|>\n")

    def ids(self, text: str) -> list[int]:
        return [int(x) for x in self.tok(text, add_special_tokens=False)["input_ids"]] if text else []

    def segment(self, msg: dict[str, str]) -> list[int]:
        return self.ids(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")

    def truncated(self, msg: dict[str, str], room: int) -> list[int]:
        """The message's segment cut to `room` tokens by keeping the head of its content."""
        header = self.ids(f"<|im_start|>{msg['role']}\n")
        keep = max(0, room - len(header) - len(self.tail))
        return header + self.ids(msg["content"])[:keep] + self.tail

    def check(self, windows: Sequence[list[dict[str, str]]]) -> int:
        """Number of windows whose assembled ids differ from `apply_chat_template`'s."""
        bad = 0
        for w in windows:
            ref = self.tok.apply_chat_template(w, tokenize=True, add_generation_prompt=True)
            ref = ref["input_ids"] if hasattr(ref, "input_ids") else ref
            bad += [int(x) for x in ref] != self.system + [t for m in w for t in self.segment(m)] + self.gen
        return bad


def turn_prompts(segments: ChatMLSegments, conversation: Sequence[dict[str, str]], max_prompt_tokens: int,
                 min_chars: int = 8) -> list[tuple[int, list[int]]]:
    """(turn index, prompt ids) for every user turn of one conversation (content >= `min_chars`).

    The prompt is the user turn with as many immediately preceding turns as fit `max_prompt_tokens`
    (system prefix and generation prompt included), starting at a user turn; a user turn that does
    not fit alone keeps the head of its content.
    """
    fixed = len(segments.system) + len(segments.gen)
    segs: dict[int, list[int]] = {}

    def seg(i: int) -> list[int]:
        if i not in segs:
            segs[i] = segments.segment(conversation[i])
        return segs[i]

    out: list[tuple[int, list[int]]] = []
    for t, msg in enumerate(conversation):
        if msg["role"] != "user" or len(msg["content"]) < min_chars:
            continue
        if fixed + len(seg(t)) > max_prompt_tokens:
            out.append((t, segments.system + segments.truncated(msg, max_prompt_tokens - fixed) + segments.gen))
            continue
        start, used = t, fixed + len(seg(t))
        while start >= 2 and used + len(seg(start - 1)) + len(seg(start - 2)) <= max_prompt_tokens:
            used += len(seg(start - 1)) + len(seg(start - 2))  # a (user, assistant) pair at a time
            start -= 2
        out.append((t, segments.system + [x for i in range(start, t + 1) for x in seg(i)] + segments.gen))
    return out


def tokenize_prompts(tokenizer: Any, texts: Sequence[str], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-formatted prompt ids (generation prompt appended); prompts longer than the cap are skipped."""
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(x) for x in ids]
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def split_prompts(prompts: list[list[int]], *, n_calib: int, n_test: int, seed: int = 0) -> tuple[list, list, list]:
    """Held-out splits are disjoint from training prompts (shuffled with a fixed seed)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    test = [prompts[i] for i in order[:n_test]]
    calib = [prompts[i] for i in order[n_test:n_test + n_calib]]
    train = [prompts[i] for i in order[n_test + n_calib:]]
    return train, calib, test


def generate_answers(target: LlamaTarget, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int,
                     batch_size: int = 256, temperature: float = 0.0, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt + answer, prompt length) per prompt; batches sorted by prompt length.

    Greedy by default (runs 1-6). With `temperature` > 0 each answer token is drawn from the
    target's softmax(logits / temperature) (DeepSpec regenerates its training answers at 0.7) by
    one generator seeded with `seed` on the target's device: the same prompts, batch size and seed
    give the same answers.
    """
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    seqs: list[tuple[list[int], int] | None] = [None] * len(prompts)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        batch = [list(prompts[i]) for i in idx]
        res = autoregressive_generate(target, batch, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                      temperature=temperature, generator=gen)
        for i, p, ans in zip(idx, batch, res.outputs):
            seqs[i] = (p + ans, len(p))
        logger.info("generated %d/%d answers", min(lo + batch_size, len(order)), len(order))
    return [s for s in seqs if s is not None]


def pad_batch(seqs: Sequence[tuple[list[int], int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B,T], prompt lengths [B], true lengths [B]."""
    t = max(len(s) for s, _ in seqs)
    tokens = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    for i, (s, _) in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    plen = torch.tensor([p for _, p in seqs], dtype=torch.long)
    lens = torch.tensor([len(s) for s, _ in seqs], dtype=torch.long)
    return tokens.to(device), plen.to(device), lens.to(device)
