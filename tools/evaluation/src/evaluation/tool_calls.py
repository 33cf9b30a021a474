"""Tool calls in eval answers and references, in one text form the scorers compare.

Owns reading the calls of a chat-completion message and their text form,
`{"tool_calls": [{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]}`
(arguments kept as the JSON text the model wrote, so a scorer can tell invalid JSON).
A message's calls are its `tool_calls`; when it has none, Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in its content count
too: that is what a server without a tool parser (vLLM without `--tool-call-parser
hermes`) returns for a model trained with the trainer's `chatml-tools` template.
Does not own: scoring (`evaluation.scorers.tool_call`), HTTP (`evaluation.eval_run`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

Call = tuple[str, str]  # (function name, arguments as JSON text)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def calls_text(calls: Sequence[Call]) -> str:
    """The text form of `calls` (what Answer.output and Sample.reference hold)."""
    return json.dumps(
        {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}, ensure_ascii=False
    )


def read_calls(text: str) -> list[Call] | None:
    """The calls of a text form; None when `text` is not one (a plain answer)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) != {"tool_calls"}:
        return None
    calls = data["tool_calls"]
    if not isinstance(calls, list):
        return None
    return [
        (str(c.get("name", "")), str(c.get("arguments", ""))) for c in calls if isinstance(c, dict)
    ]


def _args_text(args: Any) -> str:
    """Arguments as JSON text: a string stays as the model wrote it, an object is dumped."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _hermes_calls(content: str) -> list[Call]:
    out: list[Call] = []
    for block in _BLOCK.findall(content):
        try:
            call = json.loads(block)
        except ValueError:
            out.append(("", block))  # a call that is not even JSON: wrong function, bad args
            continue
        if not isinstance(call, dict):
            out.append(("", block))
            continue
        out.append((str(call.get("name", "")), _args_text(call.get("arguments", {}))))
    return out


def message_calls(message: dict[str, Any]) -> list[Call]:
    """The calls of one chat-completion message (`choices[0].message`); [] when none."""
    calls = message.get("tool_calls") or []
    out: list[Call] = []
    for c in calls if isinstance(calls, list) else []:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            out.append((str(fn.get("name", "")), _args_text(fn.get("arguments", ""))))
    if out:
        return out
    return _hermes_calls(str(message.get("content") or ""))
