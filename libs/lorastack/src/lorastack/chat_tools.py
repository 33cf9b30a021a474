"""Tool calling in chat datasets, in the OpenAI fine-tuning format:

    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],
     "messages": [..., {"role": "assistant", "content": null, "tool_calls": [
                          {"id": "call_1", "type": "function", "function": {
                               "name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "{\\"temp_c\\": 4}"},
                       {"role": "assistant", "content": "It is 4 °C in Oslo."}]}

Owns the shapes of `tools` and `tool_calls` and the checks that tie a conversation's
calls together (`tool_problems`): every call names a function of `tools`, its arguments
are a string holding a JSON object (as OpenAI sends them), every call id is answered by
a later `tool` message (except the calls of the last message: a conversation may end on
the call it teaches), and every `tool` message answers an earlier call. Does not own:
rendering (the trainer renders through the model's chat template), line numbers (the
caller parses lines).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from lorastack.errors import InvalidInput
from lorastack.untrusted_json import loads_object

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionSpec(BaseModel):
    """A function the assistant may call: its name, description and JSON Schema parameters."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object


class Tool(BaseModel):
    """An entry of a conversation's `tools`: a function."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(BaseModel):
    """The function an assistant calls, with its arguments as a JSON string."""

    name: str = Field(min_length=1)
    arguments: str  # a string holding a JSON object, as OpenAI sends it

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict; raises if they are not a JSON object."""
        return loads_object(self.arguments, what="arguments")


class ToolCall(BaseModel):
    """An assistant's call of a function, with the id its answer refers to."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_dict(self) -> dict[str, Any]:
        """The call as chat templates expect it: `arguments` stays the JSON string and is
        also given parsed (templates write `tool_call.arguments | tojson`)."""
        out = self.model_dump()
        out["function"]["arguments"] = self.function.parsed_arguments()
        return out


class _Message(Protocol):  # lorastack.chat_data.Message, read only
    @property
    def role(self) -> str: ...
    @property
    def tool_calls(self) -> list[ToolCall] | None: ...
    @property
    def tool_call_id(self) -> str | None: ...


def tool_problems(messages: Sequence[_Message], tools: Sequence[Tool] | None) -> list[str]:
    """What ties the calls of one conversation wrong, each message naming where
    (`messages.3.tool_calls.0.function.name: ...`); empty when it is consistent."""
    names = {t.function.name for t in tools or []}
    open_calls: dict[str, int] = {}  # call id -> index of the message that made it
    seen: set[str] = set()
    out: list[str] = []
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            out.append(f"messages.{i}: only an assistant message may hold tool_calls")
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages.{i}.tool_calls.{j}"
            if call.id in seen:
                out.append(f"{where}.id: call id {call.id!r} is used twice")
            seen.add(call.id)
            open_calls[call.id] = i
            if not names:
                out.append(f"{where}: the conversation calls a function but has no 'tools' list")
            elif call.function.name not in names:
                out.append(
                    f"{where}.function.name: {call.function.name!r} is not in tools "
                    f"(known: {', '.join(sorted(names))})"
                )
            try:
                call.function.parsed_arguments()
            except InvalidInput as e:
                out.append(
                    f"{where}.function.arguments: {e.message}; arguments must be a string "
                    'holding a JSON object, e.g. "{\\"city\\": \\"Oslo\\"}"'
                )
        if m.role == "tool":
            if m.tool_call_id is None:
                out.append(f"messages.{i}: a tool message needs the tool_call_id it answers")
            elif m.tool_call_id not in open_calls:
                out.append(
                    f"messages.{i}.tool_call_id: {m.tool_call_id!r} answers no earlier "
                    "assistant tool call"
                )
            else:
                del open_calls[m.tool_call_id]
        elif m.tool_call_id is not None:
            out.append(f"messages.{i}: only a tool message may hold tool_call_id")
    for call_id, i in open_calls.items():
        if i == len(messages) - 1:
            continue  # the conversation ends on the call: the call is the target
        out.append(f"messages.{i}.tool_calls: call {call_id!r} is never answered by a tool message")
    return out


def dump_arguments(arguments: dict[str, Any]) -> str:
    """Arguments as OpenAI sends them: compact JSON text, keys in the given order."""
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))
