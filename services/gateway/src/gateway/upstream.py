"""All HTTP to the backends' inference routes: open a request with retries, then read it.

Retries (tenacity) happen only before the first byte reached the client: on connection
errors and on 502/503 answers, capped at `retry_attempts` with jittered exponential
backoff, each attempt on a backend not tried yet when routing has one. A 4xx, a timeout
waiting for the first byte and anything after the response started are never retried.

Timeouts: connect, first byte (headers and first body chunk), idle gap (between two body
chunks). A caller that stops iterating (client disconnect) must `aclose()` the
`UpstreamCall`: an unfinished response closes its connection, and vLLM aborts the request.

The client is aiohttp, not httpx: on the fake upstream httpx cost 2.5 ms of CPU per
16-chunk stream at 1 stream and 5.4-6.8 ms at 64 (its pool rescans every connection per
request); aiohttp cost 0.7 ms at both (bench/results/gateway-latency.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from gateway.errors import UpstreamBroken, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.routing import InflightCounter
from gateway.settings import GatewaySettings

RETRY_STATUSES = (502, 503)
MAX_ERROR_BODY = 64 * 1024  # bytes of an upstream error body kept


class _Retryable(Exception):
    def __init__(self, backend: str, why: str) -> None:
        super().__init__(f"{backend}: {why}")


@dataclass
class UpstreamCall:
    """One open upstream response; iterate `chunks()` once, then `aclose()`."""

    backend: str
    response: aiohttp.ClientResponse
    settings: GatewaySettings
    inflight: InflightCounter
    closed: bool = field(default=False)
    complete: bool = field(default=False)  # the body was read to its end

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/json")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamTimeout or UpstreamBroken."""
        reader = self.response.content
        s = self.settings
        watch = _SilenceWatch(reader, s.first_byte_timeout_s)
        try:
            while True:
                watch.reading()
                try:
                    chunk = await reader.readany()
                except _Silence as e:
                    raise UpstreamTimeout(
                        f"{self.backend} sent nothing for {e.seconds:g} s",
                        "raise LORASTACK_IDLE_TIMEOUT_S / LORASTACK_FIRST_BYTE_TIMEOUT_S",
                    ) from None
                except aiohttp.ClientError as e:
                    raise UpstreamBroken(
                        f"the backend {self.backend} broke the response: {type(e).__name__}",
                        "retry the request",
                    ) from None
                if not chunk:
                    self.complete = True
                    return
                watch.got(s.idle_timeout_s)
                yield chunk
        finally:
            watch.stop()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.inflight.add(self.backend, -1)
            if self.complete:
                self.response.release()  # back to the keep-alive pool
            else:
                self.response.close()  # drop the connection: vLLM aborts the request


class _Silence(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"nothing for {seconds:g} s")
        self.seconds = seconds


class _SilenceWatch:
    """The first-byte and idle timeouts of one response, with one timer per response.

    A timeout context per chunk (asyncio.timeout) costs a timer per chunk; here each chunk
    only notes the time, and the timer, when due, re-arms itself from the last read
    unless the reader has really waited `limit` seconds: then it fails the reader with
    `_Silence`, which the pending `readany()` raises. Only time spent waiting for the
    backend counts: while the caller is busy (e.g. a slow client holds the send), the
    watch is paused.
    """

    __slots__ = ("_handle", "_limit", "_loop", "_reader", "_since")

    def __init__(self, reader: aiohttp.StreamReader, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._limit = limit
        self._since: float | None = None  # when the current read began; None: not reading
        self._handle = self._loop.call_later(limit, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def got(self, next_limit: float) -> None:
        """A chunk arrived; from now on the limit is `next_limit` (the idle gap)."""
        self._since = None
        if next_limit != self._limit:  # once per response: first byte -> idle
            self._limit = next_limit
            self._handle.cancel()
            self._handle = self._loop.call_later(next_limit, self._check)

    def stop(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        due = now + self._limit if self._since is None else self._since + self._limit
        if now >= due:
            self._reader.set_exception(_Silence(self._limit))
        else:
            self._handle = self._loop.call_at(due, self._check)


class Upstream:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, inflight: InflightCounter
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.inflight = inflight
        self._session: aiohttp.ClientSession | None = None
        # the retry policy, built once (per request only the AsyncRetrying loop is new)
        self._stop = stop_after_attempt(settings.retry_attempts)
        self._wait = wait_exponential_jitter(
            multiplier=settings.retry_backoff_s,
            max=settings.retry_backoff_max_s,
            jitter=settings.retry_backoff_s,
        )
        self._retry = retry_if_exception_type(_Retryable)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running event loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0),
                cookie_jar=aiohttp.DummyCookieJar(),  # a backend's cookies are not ours to keep
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self.settings.connect_timeout_s, sock_read=None
                ),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _attempt(
        self, backend: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamCall:
        self.inflight.add(backend, 1)
        try:
            try:
                async with asyncio.timeout(self.settings.first_byte_timeout_s):
                    response = await self._client().post(backend + path, data=body, headers=headers)
            except TimeoutError:
                self.metrics.upstream_errors.labels(backend, "timeout").inc()
                raise UpstreamTimeout(
                    f"{backend} did not answer within {self.settings.first_byte_timeout_s:g} s",
                    "raise LORASTACK_FIRST_BYTE_TIMEOUT_S or check the backend",
                ) from None
            except aiohttp.ClientError as e:
                # refused, reset, or a keep-alive connection the backend closed as it was
                # reused: no response byte has arrived, so another attempt is safe
                self.metrics.upstream_errors.labels(backend, "connect").inc()
                raise _Retryable(backend, f"{type(e).__name__}: {e}") from None
            if response.status >= 400:
                try:
                    raw = await response.content.read(MAX_ERROR_BODY)
                except aiohttp.ClientError:
                    raw = b""
                response.close()
                if response.status >= 500:
                    self.metrics.upstream_errors.labels(backend, "status_5xx").inc()
                if response.status in RETRY_STATUSES:
                    raise _Retryable(backend, f"HTTP {response.status}")
                raise UpstreamRejected(response.status, raw)
        except BaseException:
            self.inflight.add(backend, -1)
            raise
        return UpstreamCall(backend, response, self.settings, self.inflight)

    async def open(
        self,
        pick: Callable[[Collection[str]], str],
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> UpstreamCall:
        """POST to the backend `pick(tried)` chooses; retry only before the first byte."""
        tried: list[str] = []
        retrying = AsyncRetrying(stop=self._stop, wait=self._wait, retry=self._retry, reraise=False)
        try:
            async for attempt in retrying:
                with attempt:
                    if tried:
                        self.metrics.retries.inc()
                    backend = pick(tried)
                    tried.append(backend)
                    return await self._attempt(backend, path, body, headers)
        except RetryError as e:
            last = e.last_attempt.exception()
            raise UpstreamUnavailable(
                f"no backend answered after {len(tried)} attempts (last: {last})",
                "retry later; check the inference service",
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover
