"""Supervised tokens are exactly the assistant content plus the end-of-turn token (for a
tool chat: the assistant's rendered calls and answers, never the tool results)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from lorastack.chat_data import Conversation, Message
from trainer.data.chat_templates import apply_choice
from trainer.data.demo_tools import make_tool_demo
from trainer.data.masking import (
    IGNORE,
    MaskingError,
    Span,
    labels_from_mask,
    locate_target,
    part_lengths,
    supervised_mask,
    targets_end_with,
)
from trainer.data.samples import encode, render

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


def _runs(labels: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    prev = IGNORE
    for lab in labels:
        if lab != IGNORE:
            if prev == IGNORE:
                runs.append([])
            runs[-1].append(lab)
        prev = lab
    return runs


@pytest.fixture(scope="module")
def smollm2_tokenizer(embedded_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)


def test_tool_chat_supervises_the_calls_and_answers_never_the_results(
    smollm2_tokenizer: Any,
) -> None:
    tok = apply_choice(copy.deepcopy(smollm2_tokenizer), "chatml-tools")
    conv = make_tool_demo(1, seed=3)[0]
    sample = encode(conv, tok, "all_assistant")

    def call_text(m: Message) -> str:
        assert m.tool_calls
        f = m.tool_calls[0].function
        return f'<tool_call>\n{{"name": "{f.name}", "arguments": {f.arguments}}}\n</tool_call>'

    _, _, call1, result, answer, _, call2 = conv.messages
    expected = [call_text(call1), str(answer.content), call_text(call2)]
    assert [tok.decode(r) for r in _runs(sample.labels)] == [e + "<|im_end|>" for e in expected]
    # the tool result, the tools list and the user turns are context
    assert str(result.content) in sample.rendered
    supervised = "".join(tok.decode(r) for r in _runs(sample.labels))
    assert str(result.content) not in supervised and "get_weather" in sample.rendered
    assert sample.supervised == sum(len(tok(e)["input_ids"]) + 1 for e in expected)

    last = encode(conv, tok, "last_assistant")
    assert tok.decode([t for t in last.labels if t != IGNORE]) == expected[2] + "<|im_end|>"


def test_chatml_tools_renders_a_plain_chat_as_smollm2_does(smollm2_tokenizer: Any) -> None:
    tools_tok = apply_choice(copy.deepcopy(smollm2_tokenizer), "chatml-tools")
    for msgs in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    ):
        for prompt in (False, True):
            assert render(tools_tok, msgs, prompt) == render(smollm2_tokenizer, msgs, prompt)


def test_a_template_without_tool_support_is_refused(smollm2_tokenizer: Any) -> None:
    conv = make_tool_demo(1, seed=3)[0]
    with pytest.raises(MaskingError, match=r"no tool support.*chat_template: chatml-tools"):
        encode(conv, smollm2_tokenizer, "all_assistant")  # SmolLM2's own template
    # a template that names tools and tool_calls but writes only the content
    dropping = copy.deepcopy(smollm2_tokenizer)
    dropping.chat_template = (
        "{# tool_calls #}{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(MaskingError, match=r"drops the tool call (calculate|get_weather)"):
        encode(conv, dropping, "all_assistant")


def test_encoding_in_worker_processes_equals_one_process(smollm2_tokenizer: Any) -> None:
    """`encode_all` cut over forked workers gives what one process gives, sample for
    sample and problem for problem, in the input's order: `encode`'s ids, labels and
    parts, without the text and offsets (only `data inspect` reads them)."""
    from trainer.data.encoding import encode_all
    from trainer.data.samples import encode, end_of_turn_id

    convs = [
        Conversation.model_validate(
            {"messages": [{"role": "user", "content": f"day {i}?" + " word" * (i % 50)},
                          {"role": "assistant", "content": f"2021-01-{i % 28 + 1:02d}"}]}
        )
        for i in range(40)
    ]  # fmt: skip
    convs[7] = Conversation.model_validate(
        {"messages": [{"role": "user", "content": "what is <|im_start|>?"},
                      {"role": "assistant", "content": "a marker"}]}
    )  # fmt: skip
    specials = [t for t in smollm2_tokenizer.all_special_tokens if t]
    eot = end_of_turn_id(smollm2_tokenizer)

    def run(workers: int) -> list[Any]:
        got = encode_all(
            convs, smollm2_tokenizer, "all_assistant", specials, eot,
            workers=workers, parallel_from=0, chunk=6,
        )  # fmt: skip
        assert all(s is None or (s.rendered, s.offsets) == ("", []) for s, _ in got)
        return [(s and (s.input_ids, s.labels, s.parts), bad) for s, bad in got]

    one, three = run(1), run(3)
    assert one == three
    alone = encode(convs[0], smollm2_tokenizer, "all_assistant")
    assert one[0][0] == (alone.input_ids, alone.labels, alone.parts) and alone.offsets
    assert one[7][0] is None and one[7][1][0][0] == "special_token"
    assert all(s is not None for i, (s, _) in enumerate(one) if i != 7)
