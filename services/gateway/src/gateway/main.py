"""`create_app(settings)`: wiring only. Routes, the error map and the background refresh.

The proxied generation routes (`PROXIED`) are dispatched before FastAPI: on the streaming hot
path its middleware stack and router cost a send wrapper per chunk and routing work per
request (bench/gateway/history.md), and the proxy needs none of them (it maps
its own errors). Every other route is plain FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway.access import Access
from gateway.auth import Authenticator, Key, bearer_matches
from gateway.backends import Backends
from gateway.discovery import DnsFollower
from gateway.endpoints import ENDPOINTS
from gateway.errors import GatewayError, Unauthorized, error_response
from gateway.metrics import GatewayMetrics
from gateway.passthrough import passthrough
from gateway.proxy import Proxy
from gateway.request_id import request_id
from gateway.scrape import ModelInfo
from gateway.settings import GatewaySettings
from gateway.shared_claims import SharedInflight, WorkerSlot
from gateway.tokens import TokenizerCache
from gateway.upstream import Upstream, upstream_auth
from gateway.workers import share_the_gil

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


def http_error(method: str, path: str, status: int, detail: str, rid: str | None) -> Response:
    """Starlette's own HTTP errors (404, 405, ...) in the OpenAI error shape."""
    err = GatewayError(f"{method} {path}: {detail}")
    err.status = status
    err.type = "NotFoundError" if status == 404 else "BadRequestError"
    return error_response(err, rid)


def metrics_refused(metrics_key: str | None) -> Unauthorized:
    """The 401 of GET /metrics without the metrics key: what to send, or what to set."""
    if metrics_key is None:
        return Unauthorized(
            "GET /metrics is off while clients need API keys and no metrics key is set:",
            "set LORASTACK_METRICS_KEY (at least 32 characters) and give Prometheus the same"
            " key (authorization: {type: Bearer, credentials_file: FILE})",
        )
    return Unauthorized(
        "GET /metrics needs the metrics key:",
        "send `Authorization: Bearer LORASTACK_METRICS_KEY` (Prometheus: authorization:"
        " {type: Bearer, credentials_file: FILE})",
    )


def model_card(m: ModelInfo, created: int) -> dict[str, Any]:
    """One entry of /v1/models, as OpenAI's API and vLLM shape it."""
    return {
        "id": m.id,
        "object": "model",
        "created": created,
        "owned_by": "lorastack",
        "root": m.root,
        "parent": m.parent,
        "max_model_len": m.max_model_len,
    }


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
        share_the_gil()  # the loop waits less for a worker thread's turn (workers.py)
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

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        rid = request.scope.get("request_id")
        try:
            key = access.key(request.headers.get("authorization"))
        except GatewayError as e:
            return access.refuse(e, "/v1/models", rid)
        now = int(time.time())
        data = [model_card(m, now) for m in access.models(key)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One model (the `openai` client's `models.retrieve`); 404 when no backend has it."""
        rid = request.scope.get("request_id")
        key: Key | None = None
        try:
            key = access.key(request.headers.get("authorization"))
            info = await access.model(key, model_id)
        except GatewayError as e:
            return access.refuse(e, "/v1/models/{id}", rid, key)
        return JSONResponse(model_card(info, int(time.time())))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(proxy, request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(proxy, request, "/detokenize")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await passthrough(proxy, request, "/v1/embeddings", embed=True)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Ready or not, to anyone (probes); what stands behind it (backend URLs and their
        errors, models, tokenizers loading) only with `Authorization: Bearer ADMIN_KEY`."""
        loading = backends.pending_tokenizers()
        failed = backends.failed_tokenizers()  # a model that would answer 503: not ready
        up = any(st.up and st.models for st in backends.states.values())
        ok = up and not loading and not failed
        body: dict[str, Any] = {"ready": ok}
        if bearer_matches(admin_key, request.headers.get("authorization")):
            states = {url: ("up" if st.up else st.error) for url, st in backends.states.items()}
            body |= {
                "backends": states,
                "models": sorted(backends.catalog()),
                "loading_tokenizers": loading,
                "failed_tokenizers": failed,
            }
        return JSONResponse(body, status_code=200 if ok else 503)

    metrics_key = settings.metrics_key.get_secret_value() if settings.metrics_key else None
    metrics_open = metrics_key is None and not settings.auth_required  # an open gateway

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """Prometheus text. It names every key and backend: while clients need keys, or
        a metrics key is set, only for `Authorization: Bearer METRICS_KEY`."""
        if not metrics_open and not bearer_matches(
            metrics_key, request.headers.get("authorization")
        ):
            refused = metrics_refused(metrics_key)
            return access.refuse(refused, "/metrics", request.scope.get("request_id"))
        for url, n in backends.inflight.counts.items():
            metrics.backend_inflight.labels(url).set(n)
            metrics.backend_kv_claimed.labels(url).set(backends.inflight.tokens.get(url, 0))
        metrics.kv_admission_waiting.set(backends.inflight.waiting)
        return Response(
            metrics.render(backends.states), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
