"""Typed gateway errors and the ONE place they become HTTP responses or SSE events.

    LorastackError (lorastack.errors)
    └── GatewayError                 status 500, type "internal_error"
        ├── BadRequest               400  invalid body, unsupported content
        │   ├── ContextLengthExceeded 400 prompt + max_tokens > max-model-len
        │   │                             (reason context_length)
        │   └── KvClaimTooLarge      400  n x (prompt + max_tokens) over kv_request_share
        │                                 of every backend's KV cache
        ├── PayloadTooLarge          413  body over max_body_bytes
        ├── UnsupportedMediaType     415  a body that is not declared as JSON
        ├── Unauthorized             401  missing or wrong API key (reason unauthorized)
        ├── UnknownModel             404  no backend lists the model (reason unknown_model)
        ├── ModelNotAllowed          403  the key may not use the model (reason model_not_allowed)
        ├── RateLimited              429  per-key requests or tokens per minute
        │                                 (reason rate_limited), with
        │                                 x-ratelimit-limit|remaining|reset-requests|tokens
        ├── BudgetExhausted          429  the key's token budget for the period is spent,
        │                                 until it resets
        ├── Overloaded               429  every eligible backend saturated (reason overloaded)
        ├── UpstreamRejected         the backend's own 4xx/5xx, passed through verbatim
        ├── UpstreamUnavailable      503  no backend reachable after capped retries
        ├── AdapterLoading           503  a declared adapter no backend lists yet (Retry-After)
        ├── UpstreamTimeout          504  first byte / idle gap exceeded
        ├── UpstreamBroken           502  the response broke off (mid-stream: one SSE error event)
        └── TokenizerUnavailable     503  no tokenizer for the model, so no exact length check

Before a response started, `error_response` gives the status and the OpenAI body
`{"error": {"message", "type", "param", "code"}}` (plus `request_id` when the request has
one); once a stream has started,
`sse_error_event` gives one `data: {"error": ...}` event, and the stream then closes
WITHOUT `data: [DONE]`: [DONE] says "the answer is complete", and a client that skips
unknown events must not take a cut-off answer for a whole one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

from gateway.request_id import HEADER as REQUEST_ID_HEADER
from lorastack.errors import LorastackError


class GatewayError(LorastackError):
    """Base of the gateway's errors: an HTTP status and an OpenAI-shaped error body."""

    status = 500
    type = "internal_error"
    code: str | None = None
    reason: str | None = None  # label of gateway_rejections_total, None = not a rejection

    def __init__(self, message: str, hint: str = "", *, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param

    def headers(self) -> dict[str, str]:
        """Extra response headers for this error (none here)."""
        return {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: message (with the hint), type, param and code."""
        text = f"{self.message} {self.hint}".strip() if self.hint else self.message
        return {
            "error": {"message": text, "type": self.type, "param": self.param, "code": self.code}
        }


class BadRequest(GatewayError):
    """400: an invalid body or unsupported content."""

    status = 400
    type = "BadRequestError"
    code = "invalid_request"
    reason = "invalid_request"


class ContextLengthExceeded(BadRequest):
    """400: prompt + max_tokens is more than the model's max_model_len."""

    code = "context_length_exceeded"
    reason = "context_length"


class KvClaimTooLarge(BadRequest):
    """400: a request of several sequences whose KV claim is over `kv_request_share` of
    every backend serving its model: admitted, it would shut every other request out."""

    code = "kv_claim_too_large"


class PayloadTooLarge(GatewayError):
    """413: a body over max_body_bytes."""

    status = 413
    type = "BadRequestError"
    code = "payload_too_large"
    reason = "invalid_request"


class UnsupportedMediaType(GatewayError):
    """415: a body that is not declared as JSON."""

    status = 415
    type = "BadRequestError"
    code = "unsupported_media_type"
    reason = "invalid_request"


class Unauthorized(GatewayError):
    """401: a missing or wrong API key."""

    status = 401
    type = "AuthenticationError"
    code = "invalid_api_key"
    reason = "unauthorized"

    def headers(self) -> dict[str, str]:
        """`WWW-Authenticate: Bearer`, as RFC 6750 asks of a 401."""
        return {"WWW-Authenticate": "Bearer"}


class UnknownModel(GatewayError):
    """404: no backend lists the model."""

    status = 404
    type = "NotFoundError"
    code = "model_not_found"
    reason = "unknown_model"


class _RetryLater(GatewayError):
    status = 429
    type = "RateLimitError"

    def __init__(self, message: str, hint: str = "", *, retry_after_s: float) -> None:
        super().__init__(message, hint)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class RateLimited(_RetryLater):
    """`limit`: (what, per minute, remaining, seconds until full again) of the bucket that
    refused: the `x-ratelimit-*-requests|tokens` headers OpenAI's API sends."""

    code = "rate_limit_exceeded"
    reason = "rate_limited"

    def __init__(
        self,
        message: str,
        hint: str = "",
        *,
        retry_after_s: float,
        limit: tuple[str, int, int, float] | None = None,
    ) -> None:
        super().__init__(message, hint, retry_after_s=retry_after_s)
        self.limit = limit

    def headers(self) -> dict[str, str]:
        """The `x-ratelimit-*` headers of the bucket that refused, when known."""
        out = super().headers()
        if self.limit is not None:
            what, per_min, remaining, reset_s = self.limit
            out[f"x-ratelimit-limit-{what}"] = str(per_min)
            out[f"x-ratelimit-remaining-{what}"] = str(remaining)
            out[f"x-ratelimit-reset-{what}"] = f"{round(max(0.0, reset_s), 3):g}s"
        return out


class BudgetExhausted(_RetryLater):
    """429: the key's token budget for its period is used up."""

    code = "budget_exhausted"
    reason = "budget_exhausted"


class ModelNotAllowed(GatewayError):
    """403: the key may not use the model."""

    status = 403
    type = "PermissionDeniedError"
    code = "model_not_allowed"
    reason = "model_not_allowed"


class Overloaded(_RetryLater):
    """429: every eligible backend is saturated."""

    code = "overloaded"
    reason = "overloaded"


class NoKvRoom(Overloaded):
    """No backend has KV-cache room for the request's prompt + max output (routing.fits_kv):
    it may wait for room (`kv_admit_wait_s`) before it is answered 429."""


class AdapterLoading(_RetryLater):
    """A declared adapter that no backend lists yet (its replicas are loading it)."""

    status = 503
    type = "ServiceUnavailableError"
    code = "adapter_loading"
    reason = "adapter_loading"


class UpstreamRejected(GatewayError):
    """The backend answered an error before streaming; its body is passed through."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.raw = body
        self.type = "BadRequestError" if status < 500 else "InternalServerError"

    def body(self) -> dict[str, Any]:
        """The backend's own error body when it is an OpenAI error object, else one made around
        its text (at most 2,000 characters)."""
        try:
            parsed = json.loads(self.raw)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        text = self.raw.decode("utf-8", "replace")[:2000] or self.message
        return {"error": {"message": text, "type": self.type, "param": None, "code": self.status}}


class UpstreamUnavailable(GatewayError):
    """503: no backend reachable after capped retries."""

    status = 503
    type = "ServiceUnavailableError"
    code = "upstream_unavailable"


class UpstreamTimeout(GatewayError):
    """504: the first byte or an idle gap took longer than allowed."""

    status = 504
    type = "TimeoutError"
    code = "upstream_timeout"


class UpstreamBroken(GatewayError):
    """502: the backend's response broke off (mid-stream: one SSE error event)."""

    status = 502
    type = "InternalServerError"
    code = "upstream_broken"


class TokenizerUnavailable(GatewayError):
    """503: no tokenizer (or max_model_len) for the model, so no exact length check."""

    status = 503
    type = "ServiceUnavailableError"
    code = "tokenizer_unavailable"


def as_gateway_error(exc: BaseException) -> GatewayError:
    """`exc` as a GatewayError: itself, a BadRequest for any other LorastackError, else a
    500 that names no internals."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, LorastackError):
        return BadRequest(exc.message, exc.hint)
    return GatewayError("internal error in the gateway; see its log")


def _body(err: GatewayError, request_id: str | None) -> dict[str, Any]:
    body = err.body()
    if request_id is not None and isinstance(body.get("error"), dict):
        body["error"]["request_id"] = request_id
    return body


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """The error's status, headers and OpenAI body; with `request_id`, the id goes into
    the body (`error.request_id`) and the `X-Request-Id` header."""
    err = as_gateway_error(exc)
    headers = err.headers()
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(_body(err, request_id), status_code=err.status, headers=headers)


def sse_error_event(exc: BaseException, request_id: str | None = None) -> bytes:
    """One SSE error event for a stream that already started (no [DONE] follows)."""
    err = as_gateway_error(exc)
    return b"data: " + json.dumps(_body(err, request_id)).encode() + b"\n\n"


def http_error(method: str, path: str, status: int, detail: str, rid: str | None) -> JSONResponse:
    """Starlette's own HTTP errors (404, 405, ...) in the OpenAI error shape."""
    err = GatewayError(f"{method} {path}: {detail}")
    err.status = status
    err.type = "NotFoundError" if status == 404 else "BadRequestError"
    return error_response(err, rid)
