"""Counting (gateway.tokens): the batched fast encode gives the tokenizer's own counts,
for completions (one prompt or several) and chats; long prompts are counted on threads of
lower CPU priority than the event loop."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.tokens import LONG_COUNTS, CountingTokenizer
from gateway.validation import parse_chat, parse_completion

TEXTS = ["Hello, world!", "naïve café 東京, the quick brown fox. " * 400, " \n\t", "x"]


def test_counts_equal_the_tokenizers_own(embedded_model: Path) -> None:
    hf = AutoTokenizer.from_pretrained(embedded_model)
    tok = CountingTokenizer(hf, str(embedded_model))
    many = parse_completion({"model": "m", "prompt": TEXTS})
    assert tok.count_completion(many) == [len(hf(t).input_ids) for t in TEXTS]
    ids = parse_completion({"model": "m", "prompt": [[1, 2, 3], [4]]})
    assert tok.count_completion(ids) == [3, 1]
    for text in TEXTS:
        chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": text}]}, 8)
        rendered = hf.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        expected = len(hf(rendered, add_special_tokens=False).input_ids)
        assert tok.count_chat(chat) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_long_prompts_are_counted_at_lower_priority() -> None:
    here = os.getpriority(os.PRIO_PROCESS, 0)
    there = LONG_COUNTS.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ).result()
    assert there == min(here + 10, 19)
