"""All HTTP to the backends' inference routes: open a request with retries, then read it.

Retries (tenacity) happen only before the first byte reached the client: on connection
errors (refused, connect timeout, a keep-alive connection the backend closed before
answering) and on 502/503 answers, capped at `retry_attempts` with jittered exponential
backoff (tenacity's `wait_exponential_jitter`), each attempt on a backend not tried yet
when routing has one. A 4xx, a timeout waiting for the first byte and anything after the
response started are never retried. The loop is a plain one: tenacity's AsyncRetrying
costs more per request than this small policy is worth on the path every request takes
(bench/gateway/history.md).

Timeouts: connect (`h1client.py`), first byte (the response head, then the first body
chunk), idle gap (between two body chunks): one timer per response (`_SilenceWatch`). A
caller that stops reading (client disconnect) must `aclose()` the `UpstreamCall`: an
unfinished response closes its connection (never back to the pool), and vLLM aborts the
request.

The client is `h1client.py` (asyncio Protocol + httptools), not aiohttp or httpx: it
costs less CPU per request and per chunk (bench/gateway/history.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

from tenacity import RetryCallState, wait_exponential_jitter

from gateway.claims import Claims
from gateway.errors import UpstreamBroken, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from gateway.h1client import Connection, H1Client, Pool
from gateway.h1wire import H1Error, request_bytes
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings

RETRY_STATUSES = (502, 503)
MAX_ERROR_BODY = 64 * 1024  # bytes of an upstream error body kept


class _Retryable(Exception):
    def __init__(self, backend: str, why: str) -> None:
        super().__init__(f"{backend}: {why}")


@dataclass(slots=True)
class UpstreamCall:
    """One open upstream response; `read()` (or iterate `chunks()`) to b"", then `aclose()`."""

    backend: str
    status: int
    headers: dict[str, str]
    conn: Connection
    pool: Pool
    watch: _SilenceWatch
    settings: GatewaySettings
    inflight: Claims
    tokens: int = 0  # KV claim (whole blocks) counted in `inflight` until closed
    closed: bool = field(default=False)
    complete: bool = field(default=False)  # the body was read to its end

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        """Body bytes as they arrive, b"" at the end; raises UpstreamTimeout or UpstreamBroken."""
        watch = self.watch
        watch.reading()
        try:
            chunk = await self.conn.read()
        except _Silence as e:
            raise UpstreamTimeout(
                f"{self.backend} sent nothing for {e.seconds:g} s",
                "raise LORASTACK_IDLE_TIMEOUT_S / LORASTACK_FIRST_BYTE_TIMEOUT_S",
            ) from None
        except H1Error as e:
            raise UpstreamBroken(
                f"the backend {self.backend} broke the response: {e}", "retry the request"
            ) from None
        if chunk:
            watch.got(self.settings.idle_timeout_s)
        else:
            self.complete = True
            watch.stop()
        return chunk

    def at_end(self) -> bool:
        """Whether the body has been read to its end already (the next `read()` would
        return b""); then the call counts as complete, as after that read."""
        p = self.conn.parser
        if p is None or p.body or not p.complete:  # as `Connection.read` decides
            return False
        self.complete = True
        self.watch.stop()
        return True

    async def chunks(self) -> AsyncIterator[bytes]:
        """`read()` as an iterator."""
        while chunk := await self.read():
            yield chunk

    async def aclose(self) -> None:
        """Close the call and give back its in-flight count and claim (`close`)."""
        self.close()

    def close(self) -> None:
        """`aclose` for synchronous callers (the relay's end of stream)."""
        if not self.closed:
            self.closed = True
            self.watch.stop()
            self.inflight.add(self.backend, -1, -self.tokens)
            if self.complete:
                self.pool.release(self.conn)  # back to the keep-alive pool
            else:
                self.pool.discard(self.conn)  # drop the connection: vLLM aborts the request


class _Silence(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"nothing for {seconds:g} s")
        self.seconds = seconds


class _SilenceWatch:
    """The first-byte and idle timeouts of one response, with one timer per response.

    A timeout context per read (asyncio.timeout) costs a timer per chunk; here each read
    only notes the time, and the timer, when due, re-arms itself from the last read
    unless the reader has really waited `limit` seconds: then it fails the connection
    with `_Silence`, which the pending `head()`/`read()` raises. Only time spent waiting
    for the backend counts: while the caller is busy (e.g. a slow client holds the
    send), the watch is paused. The first-byte limit applies to the wait for the head
    and to the wait for the first body chunk; from then on the idle limit.
    """

    __slots__ = ("_conn", "_handle", "_limit", "_loop", "_since")

    def __init__(
        self, conn: Connection, limit: float, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()  # tests give a loop with a fake clock
        self._conn = conn
        self._limit = limit
        self._since: float | None = None  # when the current read began; None: not reading
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(limit, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def pause(self) -> None:
        self._since = None

    def got(self, next_limit: float) -> None:
        """A chunk arrived; from now on the limit is `next_limit` (the idle gap)."""
        self._since = None
        if next_limit != self._limit and self._handle is not None:  # once: first byte -> idle
            self._limit = next_limit
            self._handle.cancel()
            self._handle = self._loop.call_later(next_limit, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        now = self._loop.time()
        due = now + self._limit if self._since is None else self._since + self._limit
        if now >= due:
            self._handle = None
            self._conn.set_exception(_Silence(self._limit))
        else:
            self._handle = self._loop.call_at(due, self._check)


def upstream_auth(settings: GatewaySettings) -> dict[str, str]:
    """The header vLLM's --api-key asks for (its /v1/* routes; /metrics is open)."""
    key = settings.vllm_api_key
    return {"authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}


class Upstream:
    """POSTs to backends over keep-alive connections, retrying before the first byte (capped,
    jittered backoff), and counts each try in `inflight`."""

    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, inflight: Claims
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.inflight = inflight
        self._client = H1Client(connect_timeout_s=settings.connect_timeout_s)
        self._auth = upstream_auth(settings)  # vLLM's --api-key, on every request
        self._wait = wait_exponential_jitter(
            multiplier=settings.retry_backoff_s,
            max=settings.retry_backoff_max_s,
            jitter=settings.retry_backoff_s,
        )

    async def aclose(self) -> None:
        """Close every idle connection."""
        self._client.close()

    async def _attempt(
        self, backend: str, path: str, body: bytes, headers: dict[str, str], tokens: int = 0
    ) -> UpstreamCall:
        """One try on `backend`, whose request and claim `open` has counted in `inflight`
        (given back here when the try fails)."""
        s = self.settings
        conn: Connection | None = None  # acquired and not handed back to `pool` yet
        watch: _SilenceWatch | None = None
        try:
            pool = self._client.pool(backend)
            try:
                conn = await pool.acquire()
                watch = _SilenceWatch(conn, s.first_byte_timeout_s)
                conn.send(
                    request_bytes(
                        "POST", pool.host_header, pool.prefix + path, body, headers | self._auth
                    )
                )
                watch.reading()
                head = await conn.head()
                watch.pause()
            except _Silence:
                self.metrics.upstream_errors.labels(backend, "timeout").inc()
                raise UpstreamTimeout(
                    f"{backend} did not answer within {s.first_byte_timeout_s:g} s",
                    "raise LORASTACK_FIRST_BYTE_TIMEOUT_S or check the backend",
                ) from None
            except H1Error as e:
                # refused, connect timeout, or a keep-alive connection the backend closed
                # as it was reused: no response byte has arrived, so another attempt is safe
                self.metrics.upstream_errors.labels(backend, "connect").inc()
                raise _Retryable(backend, f"{type(e).__name__}: {e}") from None
            call = UpstreamCall(
                backend, head.status, head.headers, conn, pool, watch, s, self.inflight, tokens
            )
            if head.status >= 400:
                raw = b""
                try:
                    while len(raw) < MAX_ERROR_BODY and (chunk := await call.read()):
                        raw += chunk
                except (UpstreamTimeout, UpstreamBroken):
                    pass
                call.closed = True  # the in-flight count is given back below
                watch.stop()
                if call.complete:
                    pool.release(conn)
                else:
                    pool.discard(conn)
                conn = None
                if head.status >= 500:
                    self.metrics.upstream_errors.labels(backend, "status_5xx").inc()
                if head.status in RETRY_STATUSES:
                    raise _Retryable(backend, f"HTTP {head.status}")
                raise UpstreamRejected(head.status, raw[:MAX_ERROR_BODY])
        except BaseException:
            self.inflight.add(backend, -1, -tokens)
            if watch is not None:
                watch.stop()
            if conn is not None:
                pool.discard(conn)  # an exchange left unfinished (cancelled, timed out)
            raise
        return call

    async def open(
        self,
        pick: Callable[[Collection[str]], str],
        path: str,
        body: bytes,
        headers: dict[str, str],
        claim: Callable[[str], int] | None = None,
    ) -> UpstreamCall:
        """POST to the backend `pick(tried)` chooses; retry only before the first byte.
        `claim(backend)` (tokens, whole KV blocks) is counted as the backend's KV claim
        while the call is open."""
        tried: list[str] = []
        backoff: RetryCallState | None = None  # made at the first retry only
        while True:
            # the pick and its claim in one hold of the count: no other request (of any
            # worker, `shared_claims.py`) takes the room between them
            with self.inflight.exclusive():
                backend = pick(tried)
                tokens = 0 if claim is None else claim(backend)
                self.inflight.add(backend, 1, tokens)
            tried.append(backend)
            try:
                return await self._attempt(backend, path, body, headers, tokens)
            except _Retryable as e:
                last = e
            if len(tried) >= self.settings.retry_attempts:
                raise UpstreamUnavailable(
                    f"no backend answered after {len(tried)} attempts (last: {last})",
                    "retry later; check the inference service",
                )
            backoff = backoff or RetryCallState(None, None, (), {})  # type: ignore[arg-type]
            backoff.attempt_number = len(tried)
            await asyncio.sleep(self._wait(backoff))
            self.metrics.retries.inc()
