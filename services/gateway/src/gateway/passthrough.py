"""Bodies passed through to a backend serving their model, answers passed back as sent:
vLLM's `/tokenize` and `/detokenize`, and `/v1/embeddings` (only to backends that embed).

The same auth, body limits, model check and per-key request limit as chat, then one
POST (no retry beyond `upstream.open`'s, no length check: nothing is generated, and vLLM
checks an embedding input's length itself).

Owns: that flow. Does not own: its pieces (the key, the model check and the error exit:
`access.py`; body reading, routing, the upstream: `proxy.Proxy`'s).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from gateway.auth import Key
from gateway.body_pool import LargeBody
from gateway.errors import BadRequest
from gateway.prepared import BACKEND_HEADER
from gateway.proxy import Proxy
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import request_id
from gateway.routing import RouteRequest


async def passthrough(
    proxy: Proxy, request: Request, path: str, *, embed: bool = False
) -> Response:
    """Forward a request the gateway does not inspect beyond its model (auth, the key's models,
    one request of its rate limit) and return the backend's whole answer."""
    rid = request_id(request.headers.get("x-request-id"))
    key: Key | None = None
    held = LargeBody()
    try:
        key = proxy.access.key(request.headers.get("authorization"))
        model, raw = await _read_model(proxy, request, held)
        held.release()  # nothing below needs the parsed body (`body_pool.py`)
        info = await proxy.access.model(key, model)
        if embed:
            proxy.backends.require_embeddings(model)
        await proxy.auth.admit(key, 0)  # counts as a request, uses no tokens
        route = RouteRequest(model, adapter=info.parent is not None, embed=embed)
        call = await proxy.send(route, path, raw, rid)
        try:
            answer = b"".join([chunk async for chunk in call.chunks()])
        finally:
            await call.aclose()
        headers = {REQUEST_ID_HEADER: rid, BACKEND_HEADER: call.backend}
        return Response(answer, call.status, headers, media_type=call.content_type)
    except Exception as e:
        return proxy.access.refuse(e, path, rid, key)
    finally:
        held.release()


async def _read_model(proxy: Proxy, request: Request, held: LargeBody) -> tuple[str, bytes]:
    """The body's `model` and its bytes (the parsed body stays with `held` alone)."""
    body, raw = await proxy.read_json(request, held)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(
            "`model` is missing or not a string",
            "name a served model (GET /v1/models lists them)",
            param="model",
        )
    return model, raw
