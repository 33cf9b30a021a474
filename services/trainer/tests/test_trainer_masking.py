"""Supervised tokens are exactly the assistant content plus the end-of-turn token."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastack.chat_data import Conversation
from trainer.masking import (
    IGNORE,
    MaskingError,
    Span,
    labels_from_mask,
    locate_target,
    part_lengths,
    supervised_mask,
    targets_end_with,
)
from trainer.samples import encode

EOT = 2

# rendered "<s>Q: hi A: yo<e>\n": tokens with char offsets
OFFSETS = [(0, 3), (3, 5), (5, 8), (8, 11), (11, 14), (14, 17), (17, 18)]
IDS = [1, 10, 11, 12, 13, EOT, 14]


@pytest.mark.parametrize(
    ("spans", "expected"),
    [
        ([Span(11, 14)], [0, 0, 0, 0, 1, 1, 0]),  # target + end-of-turn, not the trailing \n
        ([Span(8, 14)], [0, 0, 0, 1, 1, 1, 0]),  # a token overlapping the span counts
        ([], [0, 0, 0, 0, 0, 0, 0]),
    ],
)
def test_supervised_mask_table(spans: list[Span], expected: list[int]) -> None:
    assert supervised_mask(OFFSETS, IDS, spans, EOT) == [bool(x) for x in expected]


def test_mask_by_position_not_by_id() -> None:
    # pad == eos: the trailing pad (id 2) after the target stays masked
    ids = [1, 10, 13, EOT, EOT, EOT]
    offsets = [(0, 3), (3, 5), (5, 8), (8, 11), (11, 14), (14, 17)]
    assert supervised_mask(offsets, ids, [Span(5, 8)], EOT) == [0, 0, 1, 1, 0, 0]


def test_missing_end_of_turn_is_an_error() -> None:
    with pytest.raises(MaskingError, match="end-of-turn"):
        supervised_mask(OFFSETS, IDS, [Span(8, 11)], EOT)  # next token is 13, not EOT


@pytest.mark.parametrize(
    ("labels", "ok"),
    [
        ([IGNORE, 5, EOT, IGNORE], True),
        ([IGNORE, 5, EOT, IGNORE, 6, EOT], True),
        ([IGNORE, 5, 6, IGNORE], False),
        ([IGNORE, IGNORE], False),  # all masked
        ([5, EOT, 7], False),  # a run cut off at the end (truncated target)
    ],
)
def test_targets_end_with_table(labels: list[int], ok: bool) -> None:
    assert targets_end_with(labels, EOT) is ok


def test_labels_and_parts() -> None:
    mask = [False, False, True, True]
    assert labels_from_mask([1, 2, 3, 4], mask) == [IGNORE, IGNORE, 3, 4]
    assert part_lengths(OFFSETS, 3, Span(11, 17)) == {"system": 1, "history": 4, "target": 2}
    assert locate_target("ab<h>xyz", 5, "xyz") == Span(5, 8)
    with pytest.raises(MaskingError):
        locate_target("ab<h>XYZ", 5, "xyz")


def test_real_template_supervises_assistant_content_and_end_of_turn(embedded_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model)
    conv = Conversation.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Convert to ISO 8601: the third of March, 2021"},
                {"role": "assistant", "content": "2021-03-03"},
                {"role": "user", "content": "And the fourth of July, 1999?"},
                {"role": "assistant", "content": "1999-07-04"},
            ]
        }
    )
    every = encode(conv, tok, "all_assistant")
    runs: list[list[int]] = []
    prev = IGNORE
    for lab in every.labels:
        if lab != IGNORE:
            if prev == IGNORE:
                runs.append([])
            runs[-1].append(lab)
        prev = lab
    assert [tok.decode(r) for r in runs] == ["2021-03-03<|im_end|>", "1999-07-04<|im_end|>"]
    assert all(r[-1] == tok.eos_token_id == tok.pad_token_id for r in runs)  # pad == eos

    last = encode(conv, tok, "last_assistant")
    assert tok.decode([t for t in last.labels if t != IGNORE]) == "1999-07-04<|im_end|>"
    # the default system prompt, the user turns and the headers are never supervised
    assert last.parts["target"] == len(tok("1999-07-04")["input_ids"]) + 1
    assert sum(last.parts.values()) == last.length
