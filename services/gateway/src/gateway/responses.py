"""The Responses API body (`POST /v1/responses`) read as the chat request vLLM renders.

vLLM 0.32 turns a Responses request into chat messages (`instructions` -> a system
message; `input` as a string -> one user message; input items -> messages: message items
as they are (an assistant's list content -> its first part's text), `function_call` ->
an assistant tool call, `function_call_output` -> a tool message) and renders them with
the chat template, generation prompt added. `parse_responses` builds that same
`ChatRequest`, so the proxy counts, checks the length (`max_output_tokens` is the output
limit), routes and streams a Responses request the way it does a chat one; the body
itself goes to vLLM as sent.

Not accepted here (a 400 that says what to send instead): `previous_response_id` (the
conversation lives on one vLLM replica, which the gateway cannot count or reach again
reliably: send the whole conversation in `input`), reasoning and other non-text items,
and non-function tools.

Owns: the Responses body's schema and its conversion to a chat request. Pure.
Does not own: the request flow (proxy.py), counting (tokens.py).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from gateway.errors import BadRequest
from gateway.validation import ChatRequest, Passthrough, first_error, parse_chat

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesBody(Passthrough):
    """The fields of a /v1/responses body the gateway reads; the rest passes as sent."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # output tokens
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", param=where)
    parts = []
    for i, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f"{where}.content[{i}] is of type {kind!r}; this gateway serves text models"
                " and counts only text parts.",
                'send text as {"type": "input_text", "text": "..."} or as a plain string.',
                param=f"{where}.content",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _message(
    item: dict[str, Any], where: str, prev: dict[str, Any] | None
) -> dict[str, Any] | None:
    """One input item as vLLM's chat message; None when it was merged into `prev`."""
    kind = item.get("type", "message")
    prev_assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if prev_assistant is not None:
            prev_assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output, "tool_call_id": item.get("call_id")}
    if kind == "message" and isinstance(item.get("role"), str):
        content = _text_parts(item.get("content"), where)
        if item["role"] == "assistant":
            if isinstance(content, list):  # vLLM keeps the first part only
                content = content[0]["text"] if content else ""
            if prev_assistant is not None and prev_assistant.get("content") is None:
                prev_assistant["content"] = content
                return None
        return {"role": item["role"], "content": content}
    raise BadRequest(
        f"{where} is an input item of type {kind!r}; this gateway accepts message,"
        " function_call and function_call_output items.",
        "send the conversation as messages (role and text content).",
        param=where,
    )


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise BadRequest(
            f"tools[{i}] is of type {tool.get('type')!r}; this gateway accepts function tools"
            " only.",
            'declare tools as {"type": "function", "name": ..., "parameters": {...}}.',
            param=f"tools.{i}",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def parse_responses(body: dict[str, Any], max_messages: int) -> ChatRequest:
    """The chat request vLLM renders for this Responses body (checked as chat is)."""
    try:
        req = ResponsesBody.model_validate(body)
    except ValidationError as e:
        raise first_error(e) from None
    if req.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id is not supported through this gateway: the stored"
            " conversation lives on one backend, which the gateway cannot count.",
            "send the whole conversation in `input` (the earlier turns as message items).",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            msg = _message(item, f"input.{i}", messages[-1] if messages else None)
            if msg is not None:
                messages.append(msg)
    for m in messages:  # tool calls' arguments and outputs are text to the template
        if m.get("role") == "tool" and not isinstance(m.get("content"), str):
            m["content"] = json.dumps(m.get("content"))
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
    }
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    return parse_chat(chat, max_messages)
