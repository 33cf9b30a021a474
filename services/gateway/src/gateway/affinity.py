"""Where a request's cache lives: the session and prompt-prefix tables behind routing.

Two bounded LRU tables, written after a backend accepted a request and read when the
next one is routed (`RouteRequest.session_backend`, `.prefix_hits`; the scorers in
`routing.py` turn them into scores):

- sessions: session key -> the replica it used last. The key is the `X-Session-Id`
  header, else the body's `user` field (OpenAI's end-user id); none, no stickiness.
- prefixes: hash of the prompt's leading blocks -> the replica that served them last.
  The prompt is the text vLLM encodes (the chat template rendered, or the completion's
  prompt string), cut into blocks of `BLOCK_CHARS` characters; only the first
  `MAX_BLOCKS` full blocks are hashed. Each block's hash chains the previous one, so a
  hit on block i means the whole text up to it matched (as in vLLM's own prefix cache,
  whose blocks are tokens: characters need no tokenizing before the request is
  forwarded, and a chat's next turn repeats the previous prompt character for
  character). 256 characters are ~64 tokens of English, 4 of vLLM's 16-token blocks.

Owns: the two tables, the session key and the prefix hashes of a request.
Does not own: scoring (routing.py), the request flow (proxy.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from gateway.routing import RouteRequest

BLOCK_CHARS = 256  # characters per hashed block
MAX_BLOCKS = 64  # leading blocks hashed (16 K characters): enough to tell chats apart
SESSION_HEADER = b"x-session-id"  # lower-case, as ASGI gives header names
MAX_SESSION_CHARS = 256  # a longer key is hashed down (the table's memory stays bounded)


def prefix_hashes(text: str) -> tuple[bytes, ...]:
    """Chained hashes of the leading full blocks of `text` (a partial last block is not
    hashed: it changes with the next turn)."""
    out = []
    h = b""
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        block = text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS]
        h = hashlib.blake2b(h + block.encode(), digest_size=8).digest()
        out.append(h)
    return tuple(out)


def session_key(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The header wins over `user`; empty or non-string values are no session."""
    key = header if header else body.get("user")
    if not isinstance(key, str) or not key:
        return None
    if len(key) > MAX_SESSION_CHARS:
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return key


class LruTable:
    """key -> backend url, at most `size` entries; the least recently written goes first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: OrderedDict[Any, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: Any) -> str | None:
        """The backend url stored for `key`, or None (a read does not refresh the entry)."""
        return self._rows.get(key)

    def put(self, key: Any, url: str) -> None:
        """Store `url` for `key` as the newest entry, dropping the oldest past `size`."""
        self._rows[key] = url
        self._rows.move_to_end(key)
        while len(self._rows) > self.size:
            self._rows.popitem(last=False)


class Affinity:
    """The session and prefix tables of one gateway (single event loop: no lock)."""

    def __init__(self, size: int) -> None:
        self.sessions = LruTable(size)
        self.prefixes = LruTable(size)

    def route_request(
        self, model: str, adapter: bool, session: str | None, prefix: tuple[bytes, ...]
    ) -> RouteRequest:
        """The `RouteRequest` for a request: its session's last backend and, per backend, how many
        leading prompt blocks (`prefix`, block hashes) it served last."""
        hits: dict[str, int] = {}
        for i, h in enumerate(prefix):
            url = self.prefixes.get(h)
            if url is not None:
                hits[url] = i + 1  # chained: the longest match per backend wins
        return RouteRequest(
            model,
            adapter=adapter,
            session_backend=self.sessions.get(session) if session else None,
            prefix_blocks=len(prefix),
            prefix_hits=hits,
        )

    def served(self, session: str | None, prefix: tuple[bytes, ...], url: str) -> None:
        """`url` accepted the request: its session and its prefix now live there."""
        if session:
            self.sessions.put(session, url)
        for h in prefix:
            self.prefixes.put(h, url)
