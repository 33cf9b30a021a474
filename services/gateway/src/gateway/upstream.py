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
        it = self.response.content.iter_any().__aiter__()
        limit = self.settings.first_byte_timeout_s
        while True:
            try:
                async with asyncio.timeout(limit):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                self.complete = True
                return
            except TimeoutError:
                raise UpstreamTimeout(
                    f"{self.backend} sent nothing for {limit:g} s",
                    "raise LORASTACK_IDLE_TIMEOUT_S / LORASTACK_FIRST_BYTE_TIMEOUT_S",
                ) from None
            except aiohttp.ClientError as e:
                raise UpstreamBroken(
                    f"the backend {self.backend} broke the response: {type(e).__name__}",
                    "retry the request",
                ) from None
            limit = self.settings.idle_timeout_s
            yield chunk

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.inflight.add(self.backend, -1)
            if self.complete:
                self.response.release()  # back to the keep-alive pool
            else:
                self.response.close()  # drop the connection: vLLM aborts the request


class Upstream:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, inflight: InflightCounter
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.inflight = inflight
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running event loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0),
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
        s = self.settings
        tried: list[str] = []
        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.retry_attempts),
            wait=wait_exponential_jitter(
                initial=s.retry_backoff_s, max=s.retry_backoff_max_s, jitter=s.retry_backoff_s
            ),
            retry=retry_if_exception_type(_Retryable),
            reraise=False,
        )
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
