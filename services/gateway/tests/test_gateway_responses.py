"""A Responses API body read as the chat request vLLM renders from it (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.responses import parse_responses


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    req = parse_responses({"model": "m", **body}, 100)
    return [m.model_dump(exclude_none=True) for m in req.messages]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input": "Hi."}, [{"role": "user", "content": "Hi."}]),
        (
            {"input": "Hi.", "instructions": "Be brief."},
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [
                            {"type": "output_text", "text": "Hello."},
                            {"type": "output_text", "text": "dropped, as vLLM does"},
                        ],
                    },
                ]
            },
            [
                {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "assistant", "content": "Hello."},
            ],
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "Weather?"},
                    {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                ]
            },
            [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "w", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            ],
        ),
    ],
)
def test_input_becomes_vllms_messages(body: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    assert messages(body) == expected


def test_limits_stream_and_tools_carry_over() -> None:
    req = parse_responses(
        {
            "model": "m",
            "input": "Hi.",
            "max_output_tokens": 7,
            "stream": True,
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        },
        100,
    )
    assert req.max_tokens == 7 and req.stream
    assert req.tools == [
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    ]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "Hi.", "previous_response_id": "r1"}, "previous_response_id", "in `input`"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "'reasoning'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content",
            "counts only text parts",
        ),
        ({"input": "Hi.", "tools": [{"type": "web_search"}]}, "tools.0", "function tools"),
        ({"input": "Hi.", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
        ({"input": ""}, "input", "at least 1"),
        ({}, "input", "required"),
    ],
)
def test_what_the_gateway_cannot_count_is_a_clear_400(
    body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(BadRequest) as e:
        parse_responses({"model": "m", **body}, 100)
    assert e.value.param == param and says in str(e.value)
