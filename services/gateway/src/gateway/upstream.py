"""All HTTP to the backends' inference routes: open a request with retries, then read it.

Retries (tenacity) happen only before the first byte reached the client: on connection
errors and on 502/503 answers, capped at `retry_attempts` with jittered exponential
backoff, each attempt on a backend not tried yet when routing has one. A 4xx, a timeout
waiting for the first byte and anything after the response started are never retried.

Timeouts: connect (httpx), first byte (headers and first body chunk), idle gap (between
two body chunks). A caller that stops iterating (client disconnect) must `aclose()` the
`UpstreamCall`: that closes the connection, and vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

import httpx
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from gateway.errors import UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
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
    response: httpx.Response
    settings: GatewaySettings
    inflight: InflightCounter
    closed: bool = field(default=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        it = self.response.aiter_raw().__aiter__()
        limit = self.settings.first_byte_timeout_s
        while True:
            try:
                async with asyncio.timeout(limit):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamTimeout(
                    f"{self.backend} sent nothing for {limit:g} s",
                    "raise LORASTACK_IDLE_TIMEOUT_S / LORASTACK_FIRST_BYTE_TIMEOUT_S",
                ) from None
            limit = self.settings.idle_timeout_s
            yield chunk

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.inflight.add(self.backend, -1)
            await self.response.aclose()


class Upstream:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, inflight: InflightCounter
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.inflight = inflight
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s, read=None, write=60.0, pool=None
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _attempt(
        self, backend: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamCall:
        request = self.client.build_request("POST", backend + path, content=body, headers=headers)
        self.inflight.add(backend, 1)
        try:
            try:
                async with asyncio.timeout(self.settings.first_byte_timeout_s):
                    response = await self.client.send(request, stream=True)
            except TimeoutError:
                self.metrics.upstream_errors.labels(backend, "timeout").inc()
                raise UpstreamTimeout(
                    f"{backend} did not answer within {self.settings.first_byte_timeout_s:g} s",
                    "raise LORASTACK_FIRST_BYTE_TIMEOUT_S or check the backend",
                ) from None
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                self.metrics.upstream_errors.labels(backend, "connect").inc()
                raise _Retryable(backend, f"{type(e).__name__}: {e}") from None
            if response.status_code >= 400:
                raw = b""
                try:
                    async for chunk in response.aiter_raw():
                        raw += chunk
                        if len(raw) > MAX_ERROR_BODY:
                            break
                except httpx.HTTPError:
                    pass
                await response.aclose()
                if response.status_code >= 500:
                    self.metrics.upstream_errors.labels(backend, "status_5xx").inc()
                if response.status_code in RETRY_STATUSES:
                    raise _Retryable(backend, f"HTTP {response.status_code}")
                raise UpstreamRejected(response.status_code, raw[:MAX_ERROR_BODY])
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
