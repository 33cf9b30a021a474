"""Reading a proxied request off the ASGI connection: its header fields and its JSON body
within the body limits (`lorastack.untrusted_json`), mapped to the gateway's errors.

Owns: the header view and the body read. Does not own: what the body means
(`validation.py`, `prepared.py`), the request flow (`proxy.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from gateway.body_pool import LargeBody, run_for_body
from gateway.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from lorastack.errors import InvalidInput
from lorastack.untrusted_json import (
    BodyTooLarge,
    NotJson,
    body_over,
    check_body_head,
    loads_object,
)


class HeaderFields:
    """A request's header fields by lower-case name (ASGI servers lower-case them), the
    first of a repeated one as Starlette's `request.headers.get` gives it: one dict built
    per request instead of a scan of the list per field read (and an exception per absent
    field, the common case for the optional ones)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = dict(reversed(raw))

    def get(self, name: bytes) -> str | None:
        """The field's value (latin-1), or None when the request lacks it."""
        value = self._raw.get(name)
        return None if value is None else value.decode("latin-1")


def header_fields(request: Request) -> HeaderFields:
    """The header fields of `request`, read once from its ASGI scope."""
    return HeaderFields(request.scope["headers"])


async def receive_body(receive: Receive, limit: int) -> list[bytes]:
    """A request's body from its ASGI messages, as Starlette's `Request.stream()` reads
    them (ClientDisconnect when the client hangs up first), as the pieces that arrived:
    joining them is the parser's job (off the loop for a large body). Over `limit` bytes
    is an error at once, before the rest arrives."""
    pieces: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            piece = message.get("body", b"")
            if piece:
                pieces.append(piece)
                size += len(piece)
                if size > limit:
                    raise body_over(limit)
            if not message.get("more_body", False):
                return pieces
        elif kind == "http.disconnect":
            raise ClientDisconnect()


def parse_body(pieces: list[bytes], max_depth: int) -> tuple[dict[str, Any], bytes]:
    """The body's pieces joined, and parsed as a JSON object within `max_depth`."""
    raw = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return loads_object(raw, max_depth=max_depth), raw


async def read_json(
    request: Request, fields: HeaderFields, held: LargeBody, *, limit: int, max_depth: int
) -> tuple[dict[str, Any], bytes]:
    """The body as a JSON object, and its bytes, within the limits (`limit`: bytes;
    `max_depth`: nesting); a large one is parsed off the loop and kept by `held`
    (`body_pool.py`). Read from the ASGI messages and the header dict themselves: with
    Starlette's `stream()` (an async generator) and `headers` this took ~70 µs a request
    under the 64-stream bench, ~40 µs without (bench/gateway/history.md)."""
    try:
        check_body_head(fields.get(b"content-type"), fields.get(b"content-length"), limit)
        pieces = await receive_body(request.receive, limit)
        size = sum(len(piece) for piece in pieces)
        held.begin(size)
        body, raw = await run_for_body(size, parse_body, pieces, max_depth)
        held.keep(body)
        return body, raw
    except BodyTooLarge as e:
        raise PayloadTooLarge(e.message, e.hint) from None
    except NotJson as e:
        raise UnsupportedMediaType(e.message, e.hint) from None
    except InvalidInput as e:
        raise BadRequest(e.message, e.hint) from None
