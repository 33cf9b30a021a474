"""Chat datasets in the OpenAI fine-tuning format: one JSON object per line,
`{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`, and
tool-calling chats (a `tools` list, assistant `tool_calls`, `tool` messages: the shapes
and their checks live in `lorastack.chat_tools`).

Owns parsing and schema checks with line numbers. It does not tokenise (that needs the
model's tokenizer: see the trainer's preflight) and does no I/O beyond reading a file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, field_validator, model_validator

from lorastack.chat_tools import Tool, ToolCall, tool_problems
from lorastack.errors import ConfigError, InvalidInput, NotFound
from lorastack.untrusted_json import loads_object, schema_error

Role = Literal["system", "user", "assistant", "tool"]


class Message(BaseModel):
    """One chat message: a role and its content, an assistant's tool calls or a tool's answer."""

    role: Role
    content: str | None = None  # None only for an assistant message that calls tools
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.tool_calls:
            return self
        if self.content is None:
            raise ValueError(
                f"content is missing (null): only an assistant message that calls tools "
                f"(tool_calls) may have none, this is a {self.role} message"
            )
        if not self.content.strip():
            raise ValueError("content is empty")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as written in the file (and as chat templates take it): role and
        content always, the tool fields only when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def text(self) -> str:
        """The content, or "" for a message that only calls tools."""
        return self.content or ""

    @property
    def flat_text(self) -> str:
        """The content and every call (name and arguments) as one string: what the
        duplicate and special-token checks read."""
        calls = [f"{c.function.name}({c.function.arguments})" for c in self.tool_calls or []]
        return "\n".join(p for p in [self.text, *calls] if p)


class Conversation(BaseModel):
    """One training example: its messages and the tools the assistant may call."""

    messages: list[Message]
    tools: list[Tool] | None = None  # the functions the assistant may call

    @field_validator("messages")
    @classmethod
    def _shape(cls, msgs: list[Message]) -> list[Message]:
        if not msgs:
            raise ValueError("messages is empty")
        if any(m.role == "system" for m in msgs[1:]):
            raise ValueError("a system message may only come first")
        if msgs[-1].role != "assistant":
            raise ValueError("the last message must be the assistant's answer (the target)")
        if not any(m.role == "user" for m in msgs):
            raise ValueError("there is no user message")
        return msgs

    @model_validator(mode="after")
    def _calls(self) -> Conversation:
        problems = tool_problems(self.messages, self.tools)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as dicts, the way a chat template takes them."""
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as dicts, or None when there are none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def to_json(self) -> str:
        """The conversation as one JSON line (messages, and tools if any)."""
        data: dict[str, Any] = {"messages": self.message_dicts()}
        if self.tools:
            data["tools"] = self.tool_dicts()
        return json.dumps(data, ensure_ascii=False)


class LineError(BaseModel):
    """Why one line of a dataset file is not a valid conversation."""

    line: int  # 1-based
    error: str


def parse_line(raw: str | bytes, line: int) -> Conversation | str:
    """One JSONL line: its conversation, or what is wrong with it (untrusted_json's limits:
    UTF-8, no lone surrogates, nesting, numbers; then the schema above)."""
    text = raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n")
    try:
        return Conversation.model_validate(loads_object(text, what=f"line {line}"))
    except InvalidInput as e:
        return e.message.removeprefix(f"line {line} ").removeprefix("is ")
    except ValidationError as e:
        where, what = schema_error(e)
        return f"{where}: {what}" if where else what


def parse_lines(lines: Iterable[str], source: str) -> tuple[list[Conversation], list[LineError]]:
    """Parse every non-blank line; collect errors instead of stopping at the first."""
    convs: list[Conversation] = []
    errors: list[LineError] = []
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        parsed = parse_line(raw, i)
        if isinstance(parsed, str):
            errors.append(LineError(line=i, error=parsed))
        else:
            convs.append(parsed)
    return convs, errors


def load_jsonl(path: Path) -> list[Conversation]:
    """Load a chat JSONL file; raise ConfigError listing every bad line (up to 20)."""
    if not path.is_file():
        raise NotFound(f"dataset {path} does not exist", "give the path of a JSONL file")
    with path.open(encoding="utf-8") as f:
        convs, errors = parse_lines(f, str(path))
    if errors:
        shown = "\n".join(f"  {path}:{e.line}: {e.error}" for e in errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise ConfigError(
            f"{len(errors)} invalid line(s) in {path}:\n{shown}{more}",
            'each line must be {"messages": [{"role": ..., "content": ...}, ...]} ending with '
            'an assistant message (tool chats add "tools", assistant "tool_calls" and "tool" '
            "messages, as in OpenAI's fine-tuning format)",
        )
    if not convs:
        raise ConfigError(f"{path} holds no conversations", "add at least one JSONL line")
    return convs


def write_jsonl(path: Path, convs: Iterable[Conversation]) -> None:
    """Write conversations to `path`, one JSON object per line."""
    path.write_text("".join(c.to_json() + "\n" for c in convs), encoding="utf-8")
