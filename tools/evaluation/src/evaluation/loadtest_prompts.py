"""Prompts for a load test: synthetic with set token lengths, or read from a JSONL file.

Synthetic prompts are random words (seeded, different for every request and level, so
one request's prompt is not a cached prefix of another's). With a tokenizer each user
text is cut to exactly `input_len` tokens of that tokenizer (the chat template adds its
own tokens on top, as in `vllm bench serve`); without one, lengths are approximate
(1 word ≈ 1 token for these short common words) and the results say so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from lorastack.errors import ConfigError, NotFound

_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been if more when "
    "will would who so no out up into do any time my can only new some could these two may "
    "first then other its over like also back after use our just most work well way even "
    "because good each those people how year make day very still long own see think know"
)
_WORDS = tuple(_WORDS_TEXT.split())  # one string reads better than 100 quoted words


class Tokenizer(Protocol):
    """What the load test needs of a tokenizer (an HF tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """The token ids of `text`."""

    def decode(self, ids: list[int]) -> str:
        """The text of the token ids `ids`."""


class Prompt(BaseModel):
    """One request's prompt: chat messages or completion text, and its token count if known."""

    messages: list[dict[str, str]] | None = None  # chat
    text: str = ""  # completions (and the user text of a synthetic chat prompt)
    input_tokens: int | None = None  # of the user text, by the tokenizer; None if unknown


def load_tokenizer(path: Path) -> Tokenizer:
    """The HF tokenizer in the model folder `path`; raises NotFound when the folder is missing."""
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise NotFound(f"tokenizer folder {path} does not exist", "give the model's HF folder")
    tok: Tokenizer = AutoTokenizer.from_pretrained(str(path))  # type: ignore[assignment]
    return tok


def synthetic_prompts(
    n: int, input_len: int, seed: int, tokenizer: Tokenizer | None, chat: bool
) -> list[Prompt]:
    """`n` prompts of random words, each with a distinct head (no prefix-cache hits between
    them): `input_len` tokens with a tokenizer, else `input_len` words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        # a distinct head per request defeats prefix caching between requests
        words = [f"{rng.randrange(10**6)}:{i}"] + [rng.choice(_WORDS) for _ in range(input_len * 2)]
        text = " ".join(words)
        count: int | None = None
        if tokenizer is not None:
            text, count = _cut_to_tokens(tokenizer, text, input_len)
        else:
            text = " ".join(words[:input_len])
        out.append(
            Prompt(
                messages=[{"role": "user", "content": text}] if chat else None,
                text=text,
                input_tokens=count,
            )
        )
    return out


def _cut_to_tokens(tok: Tokenizer, text: str, target: int) -> tuple[str, int]:
    ids = tok.encode(text, add_special_tokens=False)[:target]
    for _ in range(4):  # decode/encode may merge tokens at the cut; trim until stable
        cut = tok.decode(ids)
        again = tok.encode(cut, add_special_tokens=False)
        if len(again) <= target:
            return cut, len(again)
        ids = ids[: target - (len(again) - target)]
    return cut, len(again)


def file_prompts(path: Path, chat: bool) -> list[Prompt]:
    """One prompt per line: {"prompt": "..."} or {"messages": [...]} (the last assistant
    turn, if any, is dropped: it is a reference answer, not part of the prompt)."""
    if not path.is_file():
        raise NotFound(f"prompts file {path} does not exist", "give a JSONL file")
    out = []
    for i, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row: Any = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{path}:{i}: not valid JSON: {e}", "one JSON object per line") from e
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
            if msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            text = "\n".join(m["content"] for m in msgs)
            out.append(Prompt(messages=msgs if chat else None, text=text))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            text = row["prompt"]
            out.append(
                Prompt(messages=[{"role": "user", "content": text}] if chat else None, text=text)
            )
        else:
            raise ConfigError(
                f"{path}:{i}: no 'prompt' string or 'messages' list",
                'write {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
            )
    if not out:
        raise ConfigError(f"{path} holds no prompts", "add at least one JSONL line")
    return out
