"""The gateway's routes other than the proxied generation ones: the models a key may use,
the bodies passed through, health, readiness and Prometheus.

`/v1/models` and `/v1/models/{id}` (what a key may use, through `access.py`'s one
authorization step), `/tokenize`, `/detokenize` and `/v1/embeddings` (`passthrough.py`),
`/health`, `/ready` (ready or not to anyone; what stands behind it with the admin key) and
`/metrics` (with the metrics key while clients need keys). Every refusal leaves through
`Access.refuse`.

Owns: those routes and the bodies they answer. Does not own: the proxied generation
routes (`endpoints.py`, `proxy.py`, dispatched before FastAPI in main.py), building the app
(main.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.access import Access
from gateway.auth import Key, bearer_matches
from gateway.backends import Backends
from gateway.errors import GatewayError, Unauthorized
from gateway.metrics import GatewayMetrics
from gateway.passthrough import passthrough
from gateway.proxy import Proxy
from gateway.scrape import ModelInfo
from gateway.settings import GatewaySettings

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


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


def model_routes(access: Access) -> APIRouter:
    """GET /v1/models and /v1/models/{id}: the models served that the caller's key may use."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        rid = request.scope.get("request_id")
        try:
            key = access.key(request.headers.get("authorization"))
        except GatewayError as e:
            return access.refuse(e, "/v1/models", rid)
        now = int(time.time())
        data = [model_card(m, now) for m in access.models(key)]
        return JSONResponse({"object": "list", "data": data})

    @router.get("/v1/models/{model_id:path}")
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

    return router


def passthrough_routes(proxy: Proxy) -> APIRouter:
    """POST /tokenize, /detokenize and /v1/embeddings: passed to a backend serving the body's
    model, its answer passed back as sent (`passthrough.py`)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(proxy, request, "/tokenize")

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(proxy, request, "/detokenize")

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await passthrough(proxy, request, "/v1/embeddings", embed=True)

    return router


def health_routes(settings: GatewaySettings, backends: Backends) -> APIRouter:
    """GET /health (the process answers) and GET /ready (a backend serves, every tokenizer
    is loaded)."""
    router = APIRouter()
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/ready")
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

    return router


def metrics_routes(
    settings: GatewaySettings, backends: Backends, access: Access, metrics: GatewayMetrics
) -> APIRouter:
    """GET /metrics: Prometheus text, the in-flight gauges set from the counts first."""
    router = APIRouter()
    metrics_key = settings.metrics_key.get_secret_value() if settings.metrics_key else None
    metrics_open = metrics_key is None and not settings.auth_required  # an open gateway

    @router.get("/metrics")
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
        return Response(metrics.render(backends.states), media_type=PROMETHEUS_TEXT)

    return router
