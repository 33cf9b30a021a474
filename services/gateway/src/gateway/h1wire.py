"""HTTP/1.1 on the wire, without I/O: request bytes out, a response parsed from bytes in.

Owns: the bytes of one proxied request (`request_bytes`), and `ResponseParser`, which
feeds the backend's bytes to httptools' response parser (llhttp: the parser uvicorn
uses) and collects the status, the headers, the body (chunked or content-length or
until EOF, decoded) and whether the message is complete and the connection reusable.
Does not own: sockets, waiting, timeouts, pooling (`h1client.py`).
"""

from __future__ import annotations

import re

import httptools

MAX_HEADERS = 64  # request header fields, Host and Content-Length not counted
MAX_HEADER_BYTES = 16 * 1024  # the request line and the header fields, encoded
# A field name is an RFC 9110 token; nothing sent may hold CR, LF or NUL (a CR/LF in a
# value forwarded from a client would end the header and start a request of its own).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FORBIDDEN = re.compile(r"[\r\n\x00]")


class H1Error(Exception):
    """The backend's HTTP/1.1 exchange failed; no byte of this has reached the client."""


class ConnectFailed(H1Error):
    """No connection: refused, unreachable, DNS, or the connect timeout."""


class Disconnected(H1Error):
    """The backend closed the connection before the response was complete."""


class BadResponse(H1Error):
    """The backend's bytes are not a valid HTTP/1.1 response."""


class BadRequestHead(ValueError):
    """A request line or header the client refuses to write (never sent, not retried)."""


def request_bytes(method: str, host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One request with a content-length body, ready to write. `host` is the Host header.

    No Accept-Encoding: the backend then answers uncompressed, and the relay forwards its
    bytes as they are. Raises BadRequestHead for a CR, LF or NUL anywhere in the head, a
    field name that is no token, a space in the method or path, more than MAX_HEADERS
    fields or a head over MAX_HEADER_BYTES (one regex scan over the joined parts: this runs
    for every proxied request).
    """
    if len(headers) > MAX_HEADERS:
        raise BadRequestHead(f"{len(headers)} header fields, at most {MAX_HEADERS} are sent")
    if _FORBIDDEN.search("".join((method, host, path, *headers, *headers.values()))):
        raise BadRequestHead("CR, LF or NUL in the request line or a header")
    if " " in method or " " in path or not all(_TOKEN.fullmatch(k) for k in headers):
        raise BadRequestHead(f"not a valid method, path or field name: {method} {path}")
    lines = [f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"]
    lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
    lines.append("\r\n")
    try:
        head = "".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise BadRequestHead("a header holds a character outside latin-1") from None
    if len(head) > MAX_HEADER_BYTES:
        raise BadRequestHead(f"request head of {len(head)} bytes, at most {MAX_HEADER_BYTES}")
    return head + body


class ResponseParser:
    """One response, fed bytes as they arrive (`feed`); body chunks collect in `body`.

    The caller takes body bytes with `take()` (`body_bytes` counts what waits). After the
    headers: `status`, `headers` (lower-case names, latin-1 values). `complete` is set when
    the message ended; then `keep_alive` says whether the connection may carry another
    request. A body that ends at EOF (neither content-length nor chunked) is complete when
    `eof()` says so.
    """

    __slots__ = (
        "_body_until_eof",
        "_parser",
        "body",
        "body_bytes",
        "complete",
        "head_done",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.body: list[bytes] = []
        self.body_bytes = 0  # in `body`
        self.complete = False
        self.keep_alive = False
        self._body_until_eof = False

    def feed(self, data: bytes) -> None:
        """Parse `data`; raises BadResponse on bytes that are not HTTP/1.1."""
        if self.complete:
            # bytes after the end of the response: nothing may follow on this connection
            self.keep_alive = False
            raise BadResponse(f"{len(data)} bytes after the end of the response")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise BadResponse("the backend upgraded the connection") from None
        except httptools.HttpParserError as e:
            raise BadResponse(f"invalid HTTP/1.1 response: {e}") from None

    def take(self) -> bytes:
        """The body bytes parsed since the last call (b"" if none)."""
        body = self.body
        if not body:
            return b""
        self.body = []
        self.body_bytes = 0
        return body[0] if len(body) == 1 else b"".join(body)

    def eof(self) -> bool:
        """The connection closed: is the response complete? (True for EOF-delimited bodies.)"""
        if not self.complete and self.head_done and self._body_until_eof:
            self.complete = True
            self.keep_alive = False
        return self.complete

    # --- httptools callbacks ---------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        """Keep one header field, its name lower-cased (parser callback)."""
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        """Take the status; a final response's head is done, and its body runs to EOF when it has
        neither content-length nor transfer-encoding (parser callback)."""
        self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim 1xx: the real response follows
            return
        self.head_done = True
        h = self.headers
        self._body_until_eof = (
            "content-length" not in h
            and "transfer-encoding" not in h
            and self.status not in (204, 304)
        )

    def on_body(self, body: bytes) -> None:
        """Collect a body chunk and count its bytes (parser callback)."""
        self.body.append(body)
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        """Mark a final response complete and note keep-alive; an interim 1xx's headers are
        dropped (parser callback)."""
        if self.status < 200:
            self.headers = {}
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
