"""Wiring: fetch what to serve, build the supervisor, expose it over HTTP, run uvicorn.

Routes (the supervisor's own port; vLLM's OpenAI API is on `settings.port`):

    GET    /health                       200 while the supervisor runs (body: vLLM alive?)
    GET    /ready                        200 once loaded and warmed up, else 503
    GET    /status                       model, adapters, KV estimate vs vLLM, restarts, log
    GET    /metrics                      Prometheus text
    POST   /admin/adapters               {"ref": "NAME[:VERSION]" or "NAME@LABEL"} -> declare
                                          for the deployment (every replica) and load here
    DELETE /admin/adapters/{served_name}  withdraw from the deployment and unload here
    POST   /admin/adapters/refresh       reconcile to the deployment's declared adapters now
    POST   /admin/labels/refresh         look where followed labels point now; switch moved ones
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.artifacts import ServedAdapter, ServedModel, fetch_adapter, fetch_model
from inference.chat_format import plan_chat_format
from inference.declared_adapters import AdapterReconciler
from inference.engine import EngineSpec, VllmServer, detect_platform
from inference.errors import AdminDenied, error_body, http_status
from inference.kv_cache import KvSetup, Platform, estimate, read_shape
from inference.label_follow import LabelFollower
from inference.metrics import build_registry, render
from inference.parity import read_reference
from inference.settings import InferenceSettings
from inference.status_report import StatusBody
from inference.supervisor import ServePlan, Supervisor
from lorastack.errors import ConfigError, InvalidInput, LorastackError
from lorastack.parity import Reference, UnreadableReference, serving_dtype
from lorastack.store import ArtifactStore, open_store
from lorastack.untrusted_json import read_object, schema_error

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024  # an admin request is a short JSON object


def gpu_memory_gib(settings: InferenceSettings) -> float:
    """GiB of the first GPU: from settings, else asked of torch (0 when unknown)."""
    if settings.gpu_memory_gib:
        return settings.gpu_memory_gib
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory) / 1024**3
    except Exception:  # no torch / no driver: the estimate says it lacks the figure
        pass
    return 0.0


def _readable(folder: Path) -> Reference | None:
    """The folder's parity reference for the dtype choice; an unreadable one counts as
    none here (its parity check refuses it, naming why)."""
    try:
        return read_reference(folder)
    except UnreadableReference as e:
        log.warning("%s (its parity check refuses it)", e)
        return None


def _fetch_preloaded(
    settings: InferenceSettings, store: ArtifactStore, model: ServedModel
) -> list[ServedAdapter]:
    """Fetch and check the adapters the serve config preloads; ConfigError for a served
    name listed twice."""
    adapters = [
        fetch_adapter(
            store,
            ref,
            model,
            max_lora_rank=settings.max_lora_rank,
            source="preload",
            workdir=settings.resolved_workdir,
        )
        for ref in settings.adapters
    ]
    names = [a.served_name for a in adapters]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"adapter(s) listed twice: {', '.join(dup)}", "list each once")
    return adapters


def prepare(settings: InferenceSettings, store: ArtifactStore) -> ServePlan:
    """Fetch and verify the model and preloaded adapters, and estimate the KV cache."""
    platform: Platform = detect_platform() if settings.engine == "auto" else settings.engine
    model = fetch_model(store, settings.model)
    adapters = _fetch_preloaded(settings, store, model)
    chat = plan_chat_format(
        model.path,
        model.manifest,
        [(a.manifest, a.path) for a in adapters],
        settings.extra_vllm_args,
    )
    shape = read_shape(model.path)
    dtype, why = settings.dtype, "set in the serve config"
    if dtype == "auto":
        references = [_readable(f) for f in [model.path, *(a.path for a in adapters)]]
        dtype, why = serving_dtype(
            [r for r in references if r is not None],
            platform=platform,
            checkpoint_dtype=shape.config_dtype,
            with_lora=settings.enable_lora,
        )
    log.info("serving in %s: %s", dtype, why)
    gpu_mem = gpu_memory_gib(settings) if platform == "cuda" else 0.0
    if platform == "cuda" and not gpu_mem:
        raise ConfigError(
            "cannot tell the GPU's memory for the KV estimate",
            "set gpu_memory_gib in the serve config (e.g. 80 for an H100)",
        )
    est = estimate(
        shape, KvSetup.from_settings(settings, platform=platform, dtype=dtype, gpu_mem_gib=gpu_mem)
    )
    log.info(
        "KV estimate: %s bytes/token, %s tokens, %.2fx at %s tokens",
        f"{est.bytes_per_token:,}",
        f"{est.capacity_tokens:,}",
        est.max_concurrency,
        settings.max_model_len,
    )
    for w in est.warnings:
        log.warning("KV cache: %s", w)
    return ServePlan(
        model=model,
        adapters=adapters,
        estimate=est,
        platform=platform,
        chat=chat,
        dtype=dtype,
        dtype_reason=why,
    )


class AdapterLoad(BaseModel):
    """The body of POST /admin/adapters: the adapter to declare and load."""

    ref: str = Field(min_length=1, max_length=300, description="adapter NAME[:VERSION]")


def _invalid(e: ValidationError | RequestValidationError) -> tuple[InvalidInput, str]:
    """A schema error as the error map's InvalidInput, and the field it names."""
    if isinstance(e, ValidationError):
        where, what = schema_error(e)
    else:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        what = str(first["msg"])
    return InvalidInput(
        f"invalid request: {where or 'body'}: {what}",
        "see the route's fields in main.py's docstring",
    ), where


async def _json_body(request: Request, model: type[AdapterLoad]) -> AdapterLoad:
    body, _ = await read_object(
        request.stream(),
        content_type=request.headers.get("content-type"),
        content_length=request.headers.get("content-length"),
        limit=MAX_BODY_BYTES,
    )
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _invalid(e)[0] from None


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def require_admin(settings: InferenceSettings, authorization: str | None) -> None:
    """/admin/* changes what every client is served: the admin key, or a loopback bind."""
    key = settings.admin_key
    if key is None:
        if settings.supervisor_host in LOOPBACK:
            return
        raise AdminDenied(
            f"/admin is off: the supervisor listens on {settings.supervisor_host} and no admin"
            " key is set",
            "set LORASTACK_ADMIN_KEY and send Authorization: Bearer KEY",
            status=403,
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), key.get_secret_value().encode()
    ):
        raise AdminDenied("/admin needs the admin key", "send Authorization: Bearer KEY")


def create_app(
    settings: InferenceSettings,
    *,
    plan: ServePlan | None = None,
    store: ArtifactStore | None = None,
    server_factory: Callable[[EngineSpec], VllmServer] = VllmServer,
) -> FastAPI:
    """The supervisor's app; `server_factory` makes the vLLM process (a fake in tests)."""
    store = store or open_store(settings)
    plan = plan or prepare(settings, store)
    supervisor = Supervisor(settings, plan, store, server_factory=server_factory)
    follower = LabelFollower(supervisor)
    reconciler = AdapterReconciler(supervisor)
    registry = build_registry(supervisor, follower, reconciler)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        supervisor.start()
        follower.start()
        reconciler.start()
        try:
            yield
        finally:
            # SIGTERM: let open requests end (the pod's preStop delay has already let the
            # gateways stop sending new ones), then stop vLLM
            await anyio.to_thread.run_sync(supervisor.drain, settings.drain_timeout_s)
            reconciler.stop()
            follower.stop()
            supervisor.stop()

    app = FastAPI(title="lorastack inference supervisor", lifespan=lifespan)
    app.state.supervisor = supervisor
    app.state.follower = follower
    app.state.reconciler = reconciler

    @app.exception_handler(LorastackError)
    async def _error(request: Request, exc: LorastackError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=http_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        err, where = _invalid(exc)
        return JSONResponse(error_body(err, where or None), status_code=http_status(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(LorastackError(f"{request.method} {request.url.path}: {exc.detail}"))
        body["error"].update(
            type="NotFoundError" if exc.status_code == 404 else "BadRequestError",
            code=exc.status_code,
        )
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        body = error_body(LorastackError("internal error in the supervisor; see its log"))
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    def health() -> JSONResponse:
        running = supervisor.state not in ("stopping", "stopped")
        vllm = supervisor.server
        body = {
            "status": "ok" if running else supervisor.state,
            "vllm_running": bool(vllm and vllm.running),
        }
        return JSONResponse(body, status_code=200 if running else 503)

    @app.get("/ready")
    def ready() -> JSONResponse:
        body = {"ready": supervisor.ready, "state": supervisor.state}
        return JSONResponse(body, status_code=200 if supervisor.ready else 503)

    @app.get("/status", response_model=StatusBody)
    def status() -> StatusBody:
        return StatusBody(
            **dict(supervisor.status()), labels=follower.status(), declared=reconciler.status()
        )

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/admin/adapters",
        status_code=201,
        openapi_extra={
            "requestBody": {
                "content": {"application/json": {"schema": AdapterLoad.model_json_schema()}}
            }
        },
    )
    async def load_adapter(request: Request) -> dict[str, object]:
        require_admin(settings, request.headers.get("authorization"))
        body = await _json_body(request, AdapterLoad)
        loaded, decl = await anyio.to_thread.run_sync(reconciler.declare, body.ref)
        return {**loaded.describe(), "declared": {"deployment": decl.deployment, "seq": decl.seq}}

    @app.post("/admin/adapters/refresh")
    async def refresh_adapters(request: Request) -> dict[str, object]:
        require_admin(settings, request.headers.get("authorization"))
        return await anyio.to_thread.run_sync(reconciler.check)

    @app.delete("/admin/adapters/{served_name:path}")
    async def unload_adapter(served_name: str, request: Request) -> dict[str, object]:
        require_admin(settings, request.headers.get("authorization"))
        unloaded, decl = await anyio.to_thread.run_sync(reconciler.withdraw, served_name)
        return {
            "unloaded": unloaded.describe() if unloaded else None,
            "declared": {"deployment": decl.deployment, "seq": decl.seq},
        }

    @app.post("/admin/labels/refresh")
    async def refresh_labels(request: Request) -> dict[str, object]:
        require_admin(settings, request.headers.get("authorization"))
        switched = await anyio.to_thread.run_sync(follower.check)
        return {"switched": switched, **follower.status()}

    return app


def serve(settings: InferenceSettings) -> int:
    """Fetch, then run the supervisor (and through it vLLM) until SIGINT/SIGTERM."""
    import uvicorn

    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.supervisor_host,
        port=settings.supervisor_port,
        log_level="warning",
        access_log=False,
    )
    return 0
