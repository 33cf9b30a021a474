"""Request ids: the client's `X-Request-Id` when it is a safe header value, else a new one.

The id goes to the backend (vLLM takes `X-Request-Id` as its own request id, so its log
lines carry it), back to the client on every response (errors and streams included),
into the error body (`error.request_id`) and into the gateway's log lines for the
request. A client value is used only when it is 1-128 printable ASCII characters (no
CR, LF or other control characters: it is written into the backend's request head and
the logs); anything else is replaced, not refused, since a request id is a courtesy.
"""

from __future__ import annotations

import os

HEADER = "X-Request-Id"
MAX_LEN = 128  # characters


def request_id(value: str | None) -> str:
    """`value` when it is a valid id, else a new random one (32 hex digits: 128 random
    bits; os.urandom is ~5x cheaper than uuid4 on the request path)."""
    if value and len(value) <= MAX_LEN and value.isascii() and value.isprintable():
        return value
    return os.urandom(16).hex()
