"""A small HTTP/1.1 client for the proxied hot path: one connection per exchange, pooled.

Owns: connections to the backends (asyncio Protocol on the running loop, uvloop in the
gateway), one keep-alive pool per backend, the connect timeout, sending a request,
waiting for the response head, reading the body as it arrives (with backpressure: a
connection stops reading while more than `HIGH_WATER` unread bytes wait), failing a
pending read on demand (`Connection.set_exception`: the timeouts of `upstream.py`), and closing
a connection whose response was not read to its end (it never goes back to the pool).
Does not own: parsing (`h1wire.py`), timeouts after the connect, retries, error mapping
(`upstream.py`).

Why not aiohttp: on the fake upstream its request path and StreamReader cost a large
share of the gateway's CPU per request and per chunk (bench/gateway/history.md);
this does only what the proxy needs.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from gateway.h1wire import BadResponse, ConnectFailed, Disconnected, ResponseParser

HIGH_WATER = 256 * 1024  # unread body bytes at which a connection stops reading
# default for `keepalive_s`, seconds an idle keep-alive connection is kept: below uvicorn's
# (vLLM's) 5 s, so the gateway, not the backend, usually closes them (fewer reuses of a
# closing socket); lower it for a backend that closes idle connections sooner
KEEPALIVE_S = 4.0


class Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one exchange at a time."""

    __slots__ = (
        "_error",
        "_loop",
        "_paused",
        "_waiter",
        "closed",
        "idle_since",
        "parser",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None  # None: no exchange under way
        self.closed = False
        self.idle_since = 0.0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # --- the exchange ------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Start an exchange: write the request (`h1wire.request_bytes`)."""
        assert self.transport is not None and self.parser is None
        self.parser = ResponseParser()
        self._error = None
        self.transport.write(data)

    async def head(self) -> ResponseParser:
        """Wait for the response head; raises Disconnected, BadResponse or the error given to
        `set_exception`."""
        p = self.parser
        assert p is not None
        while not p.head_done:
            await self._wait()
        return p

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read; b"" once the body is complete."""
        p = self.parser
        assert p is not None
        while True:
            if p.body:
                if self._paused:
                    self._paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                return p.take()
            if p.complete:
                return b""
            await self._wait()

    def set_exception(self, exc: BaseException) -> None:
        """Make the pending (or next) `head`/`read` raise `exc` (the timeouts use it)."""
        self._error = exc
        self._wake()

    def reusable(self) -> bool:
        """The exchange ended cleanly and the backend keeps the connection open."""
        p = self.parser
        return not self.closed and p is not None and p.complete and p.keep_alive

    def close(self) -> None:
        """Mark the connection closed and close its transport."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (asyncio callback)."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        """Feed bytes to the exchange's parser, pausing reads past HIGH_WATER body bytes
        (asyncio callback); bytes outside an exchange or a bad response close the connection."""
        p = self.parser
        if p is None or self._error is not None:
            # bytes while no exchange is under way (or after a failure): unusable
            self.close()
            return
        try:
            p.feed(data)
        except BadResponse as e:
            self._error = e
            self.close()
        if p.body_bytes > HIGH_WATER and not self._paused:
            self._paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        """Mark the connection closed; an unfinished response fails with Disconnected (asyncio
        callback)."""
        self.closed = True
        p = self.parser
        if p is not None and not p.eof() and self._error is None:
            self._error = Disconnected(
                "the backend closed the connection"
                + (" mid-response" if p.head_done else " before answering")
                + (f" ({type(exc).__name__}: {exc})" if exc else "")
            )
        self._wake()


class Pool:
    """The keep-alive connections to one backend (`base_url`: http[s]://host[:port]).

    Each connection `acquire` gives is handed back once: `release` (kept when its exchange
    ended cleanly) or `discard`. When none is in use and none is kept (the last idle one
    expired, or the last one in use was closed), `on_empty` is called: its `H1Client`
    drops it, so a backend that left (a replica gone from `backends_dns`) leaves no pool
    behind, and the next request to a backend that stays makes a new one."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        keepalive_s: float = KEEPALIVE_S,
        clock: asyncio.AbstractEventLoop | None = None,
        on_empty: Callable[[Pool], None] | None = None,
    ) -> None:
        if keepalive_s <= 0:
            raise ValueError(f"keepalive_s must be > 0 seconds, not {keepalive_s!r}")
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.host_header = u.netloc
        self.prefix = u.path.rstrip("/")  # a base URL may carry a path
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.base_url = base_url
        self.idle: list[Connection] = []  # oldest first; reuse takes the newest
        self.busy = 0  # connections acquired and not handed back yet
        self._on_empty = on_empty
        self._sweeper: asyncio.TimerHandle | None = None
        # whose time(), call_later() and call_at() keep the keep-alive: the running loop,
        # or one with a fake clock (tests); the connections always use the running loop
        self._clock = clock

    def _timers(self) -> asyncio.AbstractEventLoop:
        return self._clock or asyncio.get_running_loop()

    async def acquire(self) -> Connection:
        """An idle connection (newest first), or a new one; raises ConnectFailed."""
        loop = asyncio.get_running_loop()
        self._expire(self._timers().time())
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.busy += 1
                return conn
        conn = Connection(loop)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None,
                )
        except TimeoutError:
            raise ConnectFailed(f"connect timed out after {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from None
        self.busy += 1
        return conn

    def release(self, conn: Connection) -> None:
        """Hand back an acquired connection: kept if its exchange ended cleanly, else closed."""
        if not conn.reusable():
            self.discard(conn)
            return
        self.busy -= 1
        loop = self._timers()
        conn.parser = None
        conn.idle_since = loop.time()
        self.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.keepalive_s, self._sweep)

    def discard(self, conn: Connection) -> None:
        """Hand back an acquired connection to be closed (an exchange left unfinished: the
        backend aborts it)."""
        conn.close()
        self.busy -= 1
        self._if_empty()

    def _if_empty(self) -> None:
        if self.busy == 0 and not self.idle and self._on_empty is not None:
            self._on_empty(self)

    def close(self) -> None:
        """Stop the idle sweeper and close every idle connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    def _expire(self, now: float) -> None:
        idle = self.idle
        n = 0
        while n < len(idle) and (idle[n].closed or now - idle[n].idle_since >= self.keepalive_s):
            idle[n].close()
            n += 1
        if n:
            del idle[:n]

    def _sweep(self) -> None:
        loop = self._timers()
        self._sweeper = None
        self._expire(loop.time())
        if self.idle:
            due = self.idle[0].idle_since + self.keepalive_s
            self._sweeper = loop.call_at(due, self._sweep)
        else:
            self._if_empty()


class H1Client:
    """One `Pool` per backend base URL, made on first use and dropped once it holds no
    connection (`Pool.on_empty`)."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s  # seconds an idle connection stays in its pool
        self.pools: dict[str, Pool] = {}

    def pool(self, base_url: str) -> Pool:
        """The pool for `base_url`, made on first use."""
        pool = self.pools.get(base_url)
        if pool is None:
            pool = self.pools[base_url] = Pool(
                base_url,
                connect_timeout_s=self.connect_timeout_s,
                keepalive_s=self.keepalive_s,
                on_empty=self._drop,
            )
        return pool

    def _drop(self, pool: Pool) -> None:
        if self.pools.get(pool.base_url) is pool:
            del self.pools[pool.base_url]

    def close(self) -> None:
        """Close every pool's idle connections and forget the pools."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
