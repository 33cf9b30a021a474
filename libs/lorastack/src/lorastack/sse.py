"""Reading an OpenAI-style event stream, the client side: the one SSE decoder.

Owns: cutting a streamed response body into `data:` events as its bytes arrive, decoding
each event's JSON, noticing `data: [DONE]`, and the text a chunk carries. Pure (bytes in,
dicts out), so a caller can time every event by when its bytes arrived (the load test)
or just print the text (the demo). Does not own: I/O (httpx), retries, the server side
(the gateway relays upstream bytes with its own scanner, `gateway.sse`).
"""

from __future__ import annotations

import json
from typing import Any


class BadEvent(ValueError):
    """A `data:` line that is not JSON."""


class EventReader:
    """Feed the body's bytes in order; `feed` returns the events completed by them."""

    def __init__(self) -> None:
        self.done = False  # saw `data: [DONE]`; later bytes are ignored
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buffer += chunk
        events: list[dict[str, Any]] = []
        while not self.done and b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments, event: lines
            body = line[5:].strip()
            if body == b"[DONE]":
                self.done = True
                break
            try:
                events.append(json.loads(body))
            except ValueError:
                raise BadEvent(f"bad SSE data: {body[:100]!r}") from None
        return events


def chunk_text(event: dict[str, Any], *, chat: bool = True) -> str:
    """The text of a chat.completion.chunk (`delta.content`) or a text_completion (`text`)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    if chat:
        return str((first.get("delta") or {}).get("content") or "")
    return str(first.get("text") or "")
