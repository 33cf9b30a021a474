"""A request's way in and its one way out: the key, the models it may use, the error exit.

`Access.model` is the one authorization step of every route that names a model (the
proxied ones, the ones passed through, `GET /v1/models/{id}`): the key's permission is
checked before the model's existence, so a 403 or a 404 tells a key nothing of the models
it may not use. `Access.refuse` is the one error exit of every route: a log line, the
rejection counted (by reason, and by key when the key is known), the OpenAI error
response (`errors.py`).

Owns: those two steps. Does not own: the keys, their limits and usage (auth.py), the
model catalog (backends.py), the error map (errors.py).
"""

from __future__ import annotations

import logging

from fastapi.responses import Response

from gateway.auth import Authenticator, Key
from gateway.backends import Backends
from gateway.errors import GatewayError, as_gateway_error, error_response
from gateway.metrics import GatewayMetrics
from gateway.scrape import ModelInfo

log = logging.getLogger(__name__)


class Access:
    """Who may use which model, and how a refused or failed request is answered."""

    def __init__(self, auth: Authenticator, backends: Backends, metrics: GatewayMetrics) -> None:
        self.auth = auth
        self.backends = backends
        self.metrics = metrics

    def key(self, authorization: str | None) -> Key:
        """The caller's key (`Authenticator.authenticate`). Raises Unauthorized."""
        return self.auth.authenticate(authorization)

    async def model(self, key: Key, name: str) -> ModelInfo:
        """The model `name`, once `key` may use it (checked first) and a backend serves it.

        Raises ModelNotAllowed, then what `Backends.model` raises (UnknownModel listing
        only the key's models, AdapterLoading, UpstreamUnavailable)."""
        self.auth.check_model(key, name)
        return await self.backends.model(name, key.models)

    def models(self, key: Key) -> list[ModelInfo]:
        """The models served now that `key` may use, by id."""
        return sorted(
            (m for m in self.backends.catalog().values() if key.may_use(m.id)),
            key=lambda m: m.id,
        )

    def refuse(self, e: Exception, route: str, rid: str | None, key: Key | None = None) -> Response:
        """The one error exit: log line, rejection metrics, the error response.

        `route`: the metric label or path the log names; `key`: the caller's, once known
        (its rejections are counted by name too)."""
        err = as_gateway_error(e)
        if type(err) is GatewayError:
            log.exception("request %s: unexpected error on %s", rid, route)
        else:
            log.log(
                logging.WARNING if err.status >= 500 else logging.INFO,
                "request %s: %s answered %d: %s",
                rid,
                route,
                err.status,
                err.message,
            )
        if err.reason:
            self.metrics.rejections.labels(err.reason).inc()
            if key is not None:
                self.auth.rejected(key, err.reason)
        return error_response(err, rid)
