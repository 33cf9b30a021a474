"""Tool-calling chats in the OpenAI fine-tuning format: what parses, and every way the
calls of one conversation can be tied wrong, each named with its line and place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lorastack.chat_data import Conversation, load_jsonl, parse_line
from lorastack.errors import ConfigError

USER = {"role": "user", "content": "a"}
ANSWER = {"role": "assistant", "content": "b"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _call(call_id: str = "c1", name: str = "get_weather", args: Any = '{"city": "Oslo"}') -> Any:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _chat(calls: list[Any] | None = None, tool_ids: tuple[str, ...] = ("c1",), **extra: Any) -> str:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    msgs.append({"role": "assistant", "content": None, "tool_calls": calls or [_call()]})
    msgs += [{"role": "tool", "tool_call_id": i, "content": '{"temp_c": 4}'} for i in tool_ids]
    msgs.append({"role": "assistant", "content": "It is 4 °C in Oslo."})
    return json.dumps({"tools": TOOLS, "messages": msgs, **extra})


def test_a_tool_chat_parses_and_writes_back_the_same() -> None:
    conv = parse_line(_chat(), 1)
    assert isinstance(conv, Conversation)
    assert conv.has_tools
    assert conv.messages[1].content is None and conv.messages[1].text == ""
    assert conv.messages[1].tool_calls is not None
    assert conv.messages[1].tool_calls[0].function.parsed_arguments() == {"city": "Oslo"}
    again = json.loads(conv.to_json())
    assert again["tools"] == TOOLS
    assert again["messages"] == json.loads(_chat())["messages"]
    plain = parse_line('{"messages": [{"role": "user", "content": "a"}, '
                       '{"role": "assistant", "content": "b"}]}', 1)  # fmt: skip
    assert isinstance(plain, Conversation) and not plain.has_tools
    assert json.loads(plain.to_json()) == {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    }  # a plain chat writes as it always did (data digests unchanged)


def test_a_chat_may_end_on_the_call_it_teaches() -> None:
    msgs = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [_call()]},
    ]
    assert isinstance(parse_line(json.dumps({"tools": TOOLS, "messages": msgs}), 1), Conversation)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (_chat(tool_ids=()), "messages.1.tool_calls: call 'c1' is never answered"),
        (_chat(tool_ids=("c1", "c9")), "messages.3.tool_call_id: 'c9' answers no earlier"),
        (_chat(tool_ids=("c1", "c1")), "messages.3.tool_call_id: 'c1' answers no earlier"),
        (_chat([_call(name="get_time")]), "'get_time' is not in tools (known: get_weather)"),
        (_chat([_call(args="{city: Oslo}")]), "messages.1.tool_calls.0.function.arguments: "),
        (_chat([_call(args='"Oslo"')]), "must be a JSON object"),
        (_chat([_call(args={"city": "Oslo"})]), "arguments: Input should be a valid string"),
        (_chat([_call(), _call()]), "call id 'c1' is used twice"),
        (_chat(tools=None), "calls a function but has no 'tools' list"),
        (
            json.dumps({"messages": [USER, {"role": "tool", "content": "x"}, ANSWER]}),
            "messages.1: a tool message needs the tool_call_id",
        ),
        (
            json.dumps({"messages": [USER, {"role": "assistant", "content": None}]}),
            "content is missing (null): only an assistant message that calls tools",
        ),
    ],
)
def test_wrongly_tied_calls_are_named(line: str, expected: str) -> None:
    if '"tools": null' in line:
        line = json.dumps({k: v for k, v in json.loads(line).items() if k != "tools"})
    error = parse_line(line, 7)
    assert isinstance(error, str), error
    assert expected in error


def test_load_names_the_line_of_each_bad_tool_chat(tmp_path: Path) -> None:
    path = tmp_path / "tools.jsonl"
    path.write_text("\n".join([_chat(), _chat(tool_ids=()), _chat([_call(args="{")])]) + "\n")
    with pytest.raises(ConfigError) as e:
        load_jsonl(path)
    assert f"{path}:2: messages.1.tool_calls: call 'c1' is never answered" in e.value.message
    assert f"{path}:3: messages.1.tool_calls.0.function.arguments" in e.value.message
    assert "tool_calls" in e.value.hint
