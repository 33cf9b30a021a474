"""`create_app(settings)`: wiring only. Builds the gateway's parts, runs the background
loops (the backends' refresh, the DNS follower with `backends_dns`) in the app's lifespan,
and mounts the routes (`routes.py`) and the error handler.

The proxied generation routes (`PROXIED`) are dispatched before FastAPI: on the streaming hot
path its middleware stack and router cost a send wrapper per chunk and routing work per
request (bench/gateway/history.md), and the proxy needs none of them (it maps
its own errors). Every other route is plain FastAPI (`routes.py`).

Owns: who builds and starts what, and the ASGI entry point. Does not own: any route's
logic (`routes.py`, `proxy.py`, `passthrough.py`), the error map (`errors.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway.access import Access
from gateway.auth import Authenticator
from gateway.backends import Backends
from gateway.body_pool import share_the_gil
from gateway.discovery import DnsFollower
from gateway.endpoints import ENDPOINTS
from gateway.errors import http_error
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.request_id import request_id
from gateway.routes import health_routes, metrics_routes, model_routes, passthrough_routes
from gateway.settings import GatewaySettings
from gateway.shared_claims import SharedInflight, WorkerSlot
from gateway.tokens import TokenizerCache
from gateway.upstream import Upstream, upstream_auth

PROXIED = ENDPOINTS  # path -> the endpoint's handler parts


class GatewayApp(FastAPI):
    """FastAPI with the proxied routes served straight from the ASGI entry point.

    uvicorn's X-Forwarded-For/-Proto middleware (`lorastack gateway` turns uvicorn's own
    off) wraps only the FastAPI side: the proxied routes read neither the client's address
    nor the scheme, and on their path the middleware cost a call per request and a frame
    on every resume of a stream's task (bench/gateway/history.md)."""

    proxy: Proxy

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the hosts uvicorn trusts by default (its FORWARDED_ALLOW_IPS)
        trusted = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")
        middleware = ProxyHeadersMiddleware(cast(Any, self._fastapi), trusted_hosts=trusted)
        self.forwarded = cast(ASGIApp, middleware)  # uvicorn's ASGI types are its own

    async def _fastapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.forwarded(scope, receive, send)
        endpoint = PROXIED.get(scope["path"])
        if endpoint is not None and scope["method"] == "POST":
            response = await self.proxy.handle(Request(scope, receive), endpoint)
            return await response(scope, receive, send)
        rid = scope["request_id"] = request_id(_header(scope, b"x-request-id"))
        if endpoint is not None:
            response = http_error(scope["method"], scope["path"], 405, "Method Not Allowed", rid)
            return await response(scope, receive, send)
        await self.forwarded(scope, receive, _with_request_id(send, rid))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _with_request_id(send: Send, rid: str) -> Send:
    """`send` that adds `X-Request-Id` to a response that does not carry it yet (the
    FastAPI routes; off the hot path)."""
    value = rid.encode()

    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if all(k.lower() != b"x-request-id" for k, _ in headers):
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
        await send(message)

    return sender


def create_app(settings: GatewaySettings, worker: WorkerSlot | None = None) -> FastAPI:
    """The gateway app; `worker`: one of the processes of `--workers N` (`processes.py`),
    which counts its requests and metrics where every worker reads them."""
    metrics = GatewayMetrics(worker.metrics_dir if worker else None)
    scrape_client = httpx.AsyncClient(
        timeout=httpx.Timeout(settings.connect_timeout_s), headers=upstream_auth(settings)
    )
    shared = SharedInflight(worker.claims, worker.slot) if worker else None
    tokenizers = TokenizerCache(settings)
    backends = Backends(settings, metrics, tokenizers, scrape_client, inflight=shared)
    upstream = Upstream(settings, metrics, backends.inflight)
    auth = Authenticator.from_settings(settings, metrics)
    access = Access(auth, backends, metrics)
    proxy = Proxy(settings, backends, upstream, access, metrics)
    # with backends_dns the backends follow DNS: the follower adds, drains and forgets them
    follower = DnsFollower(settings, backends, metrics) if settings.backends_dns else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        share_the_gil()  # the loop waits less for a worker thread's turn (body_pool.py)
        tasks = [asyncio.create_task(backends.run())]
        if follower is not None:
            tasks.append(asyncio.create_task(follower.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await upstream.aclose()
            await scrape_client.aclose()
            await auth.limiter.aclose()

    app = GatewayApp(title="lorastack gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.proxy = proxy
    app.state.backends = backends
    app.state.metrics = metrics
    app.state.proxy = proxy

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        rid = request.scope.get("request_id")
        return http_error(request.method, request.url.path, exc.status_code, str(exc.detail), rid)

    app.include_router(model_routes(access))
    app.include_router(passthrough_routes(proxy))
    app.include_router(health_routes(settings, backends))
    app.include_router(metrics_routes(settings, backends, access, metrics))
    return app
