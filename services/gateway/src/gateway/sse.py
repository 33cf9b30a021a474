"""Byte-level scanning of a backend's SSE stream, for the relay.

Owns: cutting upstream chunks into complete events (bytes up to the blank line), noticing
the stream's last event (`data: [DONE]` for chat and completions; `event:
response.completed`, `.incomplete` or `.failed` for the Responses API), picking the usage
out of the usage event (top level, or inside `response` for the Responses API), and
dropping the usage-only event when the client did not ask for it. Only events that may hold usage or
[DONE] are split and decoded; every other chunk passes as the very bytes it arrived as
(two substring scans, no JSON, no copy when the chunk ends on an event boundary).
Does not own: I/O, timeouts, metrics (`relay.py`).
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

    __slots__ = ("_end", "_rest", "done", "keep_usage", "usage")

    def __init__(self, *, keep_usage: bool, end: tuple[bytes, ...] = CHAT_END) -> None:
        self.keep_usage = keep_usage  # forward the usage-only event (the client asked)
        self._end = end  # how the stream's last event starts
        self.usage: dict[str, Any] | None = None  # the last usage object seen
        self.done = False  # saw `data: [DONE]`
        self._rest = b""  # an incomplete event, waiting for its end

    def feed(self, chunk: bytes) -> bytes:
        """The complete events among what arrived so far (b"" when none is complete)."""
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
        for mark in self._end:
            if mark in chunk:
                return self._scan(chunk)
        return chunk

    def _scan(self, data: bytes) -> bytes:
        out = []
        for event in data.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(self._end):
                self.done = True
            if _USAGE in event:
                obj = _decode(event)
                holder = obj.get("response", obj) if isinstance(obj, dict) else None
                if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                    self.usage = holder["usage"]
                    if not self.keep_usage and not obj.get("choices"):
                        continue
            out.append(event + b"\n\n")
        return b"".join(out)


def _decode(event: bytes) -> Any:
    try:
        return json.loads(event[event.index(b"data:") + 5 :])
    except ValueError:
        return None
