"""Counting (gateway.tokens): the batched fast encode gives the tokenizer's own counts,
for completions (one prompt or several) and chats; large bodies are counted on threads of
lower CPU priority than the event loop (gateway.body_pool)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

from gateway.body_pool import POOL
from gateway.errors import BadRequest
from gateway.tokens import CountingTokenizer
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


def test_a_template_renders_the_same_with_its_globals_flattened(embedded_model: Path) -> None:
    """CountingTokenizer gives the compiled template (transformers' cached one) its
    globals as one dict (a render cost less): the text, the globals a template calls
    (raise_exception) and what it is passed (bos_token, add_generation_prompt) stay."""
    hf = AutoTokenizer.from_pretrained(embedded_model)
    hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}"
        "{{ bos_token }}{{ m['role'] | upper }}={{ m['content'] | tojson }};{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tok = CountingTokenizer(hf, str(embedded_model))
    compiled = _compile_jinja_template(hf.chat_template)
    assert type(compiled.globals) is dict and "raise_exception" in compiled.globals
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": 'a "b"'}]}, 8)
    assert tok.render_chat(chat) == '<|im_start|>USER="a \\"b\\"";>'
    assert tok.render_chat(chat) == hf.apply_chat_template(
        [{"role": "user", "content": 'a "b"'}], tokenize=False, add_generation_prompt=True
    )
    tool = parse_chat({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, 8)
    with pytest.raises(BadRequest, match="no tools here"):
        tok.render_chat(tool)


def test_upper_bound_is_never_below_the_exact_count(embedded_model: Path) -> None:
    hf = AutoTokenizer.from_pretrained(embedded_model)
    tok = CountingTokenizer(hf, str(embedded_model))
    texts = [
        *TEXTS,
        "",
        " ",
        "<|im_start|>user<|im_end|><|im_start|>",  # special tokens written in the text
        "🙂🙃" * 50 + "\u0958\ufdfa\u212b",  # emoji, and characters normalisers expand
        "".join(chr(c) for c in range(0x20, 0x3000, 7)),
        "a" * 500 + " " * 37 + "\n" * 9,
    ]
    for special in (False, True):
        exact = tok.count(list(texts), special)
        bound = tok.upper_bound(list(texts), special)
        assert all(b >= e for b, e in zip(bound, exact, strict=True)), (bound, exact)
    # token-id prompts are their own count; a chat's input is its rendered template
    ids = parse_completion({"model": "m", "prompt": [[5, 6, 7], [8]]})
    assert tok.inputs(ids) == ([3, 1], True) and tok.upper_bound([3, 1], True) == [3, 1]
    texts_req = parse_completion({"model": "m", "prompt": ["hi there", "x"]})
    inputs, special = tok.inputs(texts_req)
    assert inputs == ["hi there", "x"] and special is True
    assert tok.count(inputs, special) == tok.count_completion(texts_req) == [2, 1]
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 8)
    (rendered,), special = tok.inputs(chat)
    assert rendered.endswith("<|im_start|>assistant\n") and special is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_large_bodies_are_worked_on_at_lower_priority() -> None:
    here = os.getpriority(os.PRIO_PROCESS, 0)
    there = POOL.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert there == min(here + 10, 19)
