"""Reading an OpenAI-style event stream, the client side: the one SSE decoder.

Owns: cutting a streamed response body into `data:` events as its bytes arrive, decoding
each event's JSON, noticing `data: [DONE]`, and the text a chunk carries. Pure (bytes in,
dicts out), so a caller can time every event by when its bytes arrived (the load test)
or just print the text (the demo). Does not own: I/O (httpx), retries, the server side
(the gateway relays upstream bytes with its own scanner, `gateway.sse`).

Read by the WHATWG event-stream rules (html.spec.whatwg.org, "Interpreting an event
stream"): lines end in CRLF, LF or CR (a CRLF may be cut between two reads); `data:x` and
`data: x` are the same (one space after the colon is dropped); an event is dispatched at
its blank line, its `data` lines joined by "\n"; an event without data, a comment (":")
and other fields (`event`, `id`, `retry`) dispatch nothing; an event cut off by the end
of the stream is dropped.
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
        self._data: list[bytes] = []  # the `data` values of the event being read
        self._cr = False  # the last read ended in CR: a LF first in the next is its pair
        self._first = True  # a BOM may open the stream

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The events completed by `chunk`, parsed; none after [DONE]. BadEvent on bad JSON."""
        if self._first and chunk:
            chunk, self._first = chunk.removeprefix(b"\xef\xbb\xbf"), False
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        if chunk:
            self._cr = chunk.endswith(b"\r")
        self._buffer += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events: list[dict[str, Any]] = []
        while not self.done and b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line:
                name, _, value = line.partition(b":")
                if name == b"data":  # ":" first (name empty) is a comment
                    self._data.append(value[1:] if value[:1] == b" " else value)
                continue
            if not self._data:
                continue  # a blank line ends an event; one without data dispatches nothing
            body, self._data = b"\n".join(self._data), []
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
