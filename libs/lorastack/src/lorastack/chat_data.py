"""Chat datasets in the OpenAI fine-tuning format: one JSON object per line,
`{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`.

Owns parsing and schema checks with line numbers. It does not tokenise (that needs the
model's tokenizer: see the trainer's preflight) and does no I/O beyond reading a file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError, field_validator

from lorastack.errors import ConfigError, InvalidInput, NotFound
from lorastack.untrusted_json import loads_object, schema_error

Role = Literal["system", "user", "assistant"]


class Message(BaseModel):
    role: Role
    content: str

    @field_validator("content")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("content is empty")
        return v


class Conversation(BaseModel):
    messages: list[Message]

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

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), ensure_ascii=False)


class LineError(BaseModel):
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
            "an assistant message",
        )
    if not convs:
        raise ConfigError(f"{path} holds no conversations", "add at least one JSONL line")
    return convs


def write_jsonl(path: Path, convs: Iterable[Conversation]) -> None:
    path.write_text("".join(c.to_json() + "\n" for c in convs), encoding="utf-8")
