"""Byte-level scanning of a backend's SSE stream, for the relay.

Owns: cutting upstream chunks into complete events (bytes up to the blank line), noticing
the stream's last event (`data: [DONE]` for chat and completions; `event:
response.completed`, `.incomplete` or `.failed` for the Responses API), picking the usage
out of the usage event (top level, or inside `response` for the Responses API), and
dropping the usage-only event when the client did not ask for it. Only events that may hold usage or
[DONE] are split and decoded; every other chunk passes as the very bytes it arrived as
(two substring scans, no JSON, no copy when the chunk ends on an event boundary).
Does not own: I/O, timeouts, metrics (`relay.py`).

Events are read by the WHATWG event-stream rules (html.spec.whatwg.org, "Interpreting an
event stream"): lines end in CRLF, LF or CR; `field:value` and `field: value` are the
same (one space after the colon is dropped); an event's `data` lines are joined by "\n";
a line starting with ":" is a comment. vLLM writes LF and `data: `, the fast path; a
stream with a CR in it is forwarded with its line ends written as LF (the same events).
"""

from __future__ import annotations

import json
from typing import Any

_USAGE = b'"usage":{'  # vLLM writes compact JSON; `"usage":null` events carry none
CHAT_END = (b"data: [DONE]",)
RESPONSES_END = (
    b"event: response.completed",
    b"event: response.incomplete",
    b"event: response.failed",
)


class EventScanner:
    """Feed upstream chunks in order; `feed` returns the bytes ready for the client."""

    __slots__ = ("_cr", "_end", "_marks", "_rest", "done", "keep_usage", "usage")

    def __init__(self, *, keep_usage: bool, end: tuple[bytes, ...] = CHAT_END) -> None:
        self.keep_usage = keep_usage  # forward the usage-only event (the client asked)
        self._end = end  # the stream's last event: one of these `field: value` lines
        # what the fast path looks for: the values, found with or without the space
        self._marks = tuple(m.partition(b":")[2].strip() for m in end)
        self.usage: dict[str, Any] | None = None  # the last usage object seen
        self.done = False  # saw `data: [DONE]`
        self._rest = b""  # an incomplete event, waiting for its end
        self._cr = False  # the last chunk ended in CR: a LF first in the next one is its pair

    def feed(self, chunk: bytes) -> bytes:
        """The complete events among what arrived so far (b"" when none is complete)."""
        if b"\r" in chunk or self._cr:
            chunk = self._lf_lines(chunk)
        if self._rest:
            chunk = self._rest + chunk
        cut = chunk.rfind(b"\n\n") + 2
        if cut == 1:  # no event boundary yet
            self._rest = chunk
            return b""
        if cut == len(chunk):
            self._rest = b""
        else:
            chunk, self._rest = chunk[:cut], chunk[cut:]
        if _USAGE in chunk:
            return self._scan(chunk)
        for mark in self._marks:
            if mark in chunk:
                return self._scan(chunk)
        return chunk

    def _lf_lines(self, chunk: bytes) -> bytes:
        """`chunk` with CRLF and CR line ends written as LF (a CRLF may be cut in two)."""
        if not chunk:
            return chunk
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _scan(self, data: bytes) -> bytes:
        out = []
        for event in data.split(b"\n\n"):
            if not event:
                continue
            fields = _fields(event)
            if any(f"{k}: ".encode() + v in self._end for k, v in fields):
                self.done = True
            if _USAGE in event:
                obj = _decode(fields)
                holder = obj.get("response", obj) if isinstance(obj, dict) else None
                if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                    self.usage = holder["usage"]
                    if not self.keep_usage and not obj.get("choices"):
                        continue
            out.append(event + b"\n\n")
        return b"".join(out)


def _fields(event: bytes) -> list[tuple[str, bytes]]:
    """(field, value) of each line of one event: `field:value` or `field: value` (one space
    dropped), a line without a colon a field with an empty value, comments left out."""
    out = []
    for line in event.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        out.append((name.decode("utf-8", "replace"), value[1:] if value[:1] == b" " else value))
    return out


def _decode(fields: list[tuple[str, bytes]]) -> Any:
    """The JSON of an event's data: its `data` lines joined by "\n"."""
    try:
        return json.loads(b"\n".join(v for k, v in fields if k == "data"))
    except ValueError:
        return None
