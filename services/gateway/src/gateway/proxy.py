"""The request flow of /v1/chat/completions, /v1/completions and /v1/responses (read as
the chat request vLLM renders from it: `responses.py`); `read_json` and `send` also
serve the bodies passed through as they are (`passthrough.py`).

auth -> body limits -> parse -> model check (exists, and the key may use it) -> exact
token count -> length check (or clamp) -> per-key limits and budget -> route (admission
control) -> upstream with retries -> pass the response through (SSE chunk by chunk) ->
metrics.

Owns: that flow and its I/O (backends, upstream, metrics); the key, the model check and
the error exit are `access.py`'s, the wait for KV-cache room before the upstream is
`admission.py`'s. Its pure pieces live
apart: reading the body (`request_body.py`), what differs per path (`endpoints.py`), and
the request it forwards, built step by step (`prepared.py`). The steps whose work grows
with a large body run on worker threads (`body_pool.py`), never on the loop.

Counting while the backend works: when upper bounds prove the fit (`counting.py`), the
request is forwarded at once and counted exactly while the gateway waits for the
backend's answer (`_open_count`). A request the bounds cannot settle is counted first:
the backend never sees a request that does not fit.

Streaming: the gateway always asks the backend for `stream_options.include_usage`, so
it learns the exact output-token count for TPOT; when the client did not ask for usage,
the final usage-only event is dropped (the other events then carry `"usage": null`,
which OpenAI's own API also sends). Events are forwarded as soon as they are complete
(bytes up to the blank line); a read from the backend that holds several events is
forwarded as one write. Nothing else is buffered. The relay itself (`relay.py`) watches
for the client hanging up: that cancels it, and the stream's end closes the upstream
connection, which makes vLLM abort the request. Before the relay (the wait for admission)
and for a whole unary answer, the proxy watches the same way: a client that hangs up
leaves the admission line unsent, or its upstream call is closed, and its KV claim is
given back at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.access import Access
from gateway.admission import Admission
from gateway.affinity import SESSION_HEADER, Affinity, session_key
from gateway.auth import Key
from gateway.backends import Backends
from gateway.body_pool import LargeBody, run_for_body
from gateway.counting import count_prompts
from gateway.endpoints import Endpoint
from gateway.errors import GatewayError, UpstreamTimeout, error_response
from gateway.metrics import GatewayMetrics
from gateway.prepared import (
    BACKEND_HEADER,
    CLAMP_HEADER,
    PROMPT_TOKENS_HEADER,
    Prepared,
    client_headers,
    count_header,
    forward_body,
    kv_sequences,
    plan_output,
    prompt_prefix,
    reserved_tokens,
    wants_clamp,
)
from gateway.relay import SseRelay, StreamEnd, cancel_on_disconnect
from gateway.request_body import HeaderFields, header_fields, read_json
from gateway.request_id import request_id
from gateway.routing import RouteRequest, Thresholds, Weights
from gateway.settings import GatewaySettings
from gateway.upstream import Upstream, UpstreamCall

log = logging.getLogger(__name__)


class Proxy:
    """The generation routes: authenticates, validates and counts a request, admits it to a
    backend, then answers or relays its stream."""

    def __init__(
        self,
        settings: GatewaySettings,
        backends: Backends,
        upstream: Upstream,
        access: Access,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.backends = backends
        self.upstream = upstream
        self.access = access
        self.auth = access.auth  # the key's limits, budget and usage
        self.metrics = metrics
        self.weights = Weights(
            prefix=settings.prefix_weight,
            session=settings.session_weight,
            static=settings.static_weight,
        )
        thresholds = Thresholds(
            settings.admit_max_kv_usage, settings.admit_max_waiting, settings.kv_request_share
        )
        self.admission = Admission(settings, backends, upstream, thresholds, self.weights)
        self.affinity = Affinity(settings.affinity_table_size)

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        """Serve one request to `endpoint`: a JSON answer, an SSE relay, or the error response; a
        client that hangs up cancels the request."""
        t0 = time.perf_counter()
        self.metrics.inflight.inc()
        done_here = True  # a streaming response takes the in-flight count over
        fields = header_fields(request)
        rid = request_id(fields.get(b"x-request-id"))
        key: Key | None = None
        held = LargeBody()
        task = asyncio.current_task()
        assert task is not None
        left: list[bool] = []  # the watcher appends once the client has hung up
        watcher: asyncio.Task[None] | None = None
        try:
            key = self.access.key(fields.get(b"authorization"))
            prep = await self._prepare(request, fields, endpoint, rid, key, held)
            held.release()  # nothing below needs the parsed body (`body_pool.py`)
            # the body is read: from here the client hanging up cancels the request, which
            # leaves the admission line and closes the upstream call (vLLM aborts it, the
            # claim is given back); a stream's relay watches on its own
            watcher = asyncio.create_task(cancel_on_disconnect(request.receive, task, left))
            if prep.count_later is None:
                call = await self._open(prep)
            else:
                prep, call = await self._open_count(prep)
            if prep.stream:
                watcher.cancel()
                done_here = False
                return SseRelay(
                    call,
                    prep.headers,
                    keep_usage=prep.client_wants_usage,
                    t0=t0,
                    request_id=rid,
                    on_end=lambda end: self._end_stream(prep, call, t0, end),
                    end=endpoint.end,
                )
            return await self._unary(prep, call, t0)
        except asyncio.CancelledError:
            if not left or task.uncancel() > 0:  # not the client leaving: the server stopping
                raise
            log.info("request %s: the client left before the answer", rid)
            return Response(status_code=499)
        except Exception as e:
            return self.access.refuse(e, endpoint.label, rid, key)
        finally:
            if watcher is not None:
                watcher.cancel()
            held.release()  # where the preparation failed, once its frames are gone
            if done_here:
                self.metrics.inflight.dec()

    # --- before the upstream ------------------------------------------------
    async def read_json(
        self, request: Request, held: LargeBody, fields: HeaderFields | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """The body as a JSON object, and its bytes, within the limits (`request_body.py`)."""
        return await read_json(
            request,
            fields or header_fields(request),
            held,
            limit=self.settings.max_body_bytes,
            max_depth=self.settings.max_json_depth,
        )

    async def _prepare(
        self,
        request: Request,
        fields: HeaderFields,
        endpoint: Endpoint,
        rid: str,
        key: Key,
        held: LargeBody,
    ) -> Prepared:
        """Parse, model check, counting, length check (or clamp), limits and budget, body
        rewrite: each a step of its own (`endpoints.py`, `counting.py`, `prepared.py`).
        A large body's objects stay with `held` (`body_pool.py`)."""
        body, raw = await self.read_json(request, held, fields)
        size = len(raw)  # a large body's parse, count and rewrite run off the loop
        req = await run_for_body(size, endpoint.parse, body, self.settings.max_messages)
        held.keep(req)
        info = await self.access.model(key, req.model)
        max_len = self.backends.max_model_len(info)
        tok = await self.backends.tokenizer_for(info)
        param, requested = endpoint.requested_output(req)
        exact_first = key.tokens is not None or key.budget is not None  # limits need it
        inputs, counts, count_later = await count_prompts(
            tok, req, requested, max_len, param, exact_first=exact_first, body_bytes=size
        )
        clamp = wants_clamp(self.settings.clamp_max_tokens, fields.get(CLAMP_HEADER))
        out = plan_output(counts, requested, max_len, clamp=clamp, param=param)
        if out.clamped_from is not None:
            self.metrics.clamped.inc()
        reserved = reserved_tokens(counts, out, req.n)
        wants_usage = endpoint.client_wants_usage(req)
        forward = await run_for_body(  # before admission: nothing to refund if cancelled here
            size, forward_body, body, raw, req, param=param, out=out, client_wants_usage=wants_usage
        )
        reservation = await self.auth.admit(key, reserved)
        return Prepared(
            model=req.model,
            endpoint=endpoint,
            stream=req.stream,
            client_wants_usage=wants_usage,
            body=forward,
            headers=client_headers(rid, counts if count_later is None else None, out),
            key=key,
            reserved_tokens=reserved,
            kv_sequences=kv_sequences(counts, out, req.n),
            reservation=reservation,
            prompt_tokens=sum(counts),
            adapter=info.parent is not None,
            request_id=rid,
            session=session_key(fields.get(SESSION_HEADER), body),
            prefix=prompt_prefix(inputs, self.weights.prefix),
            count_later=count_later,
        )

    async def _open(self, prep: Prepared) -> UpstreamCall:
        route_req = self.affinity.route_request(prep.model, prep.adapter, prep.session, prep.prefix)
        # its KV claim: prompts (the bound, while counted later) + max output of every choice
        route_req = replace(route_req, sequences=prep.kv_sequences)
        try:
            call = await self.send(route_req, prep.endpoint.path, prep.body, prep.request_id)
        except (GatewayError, asyncio.CancelledError):  # not answered: nothing counted as used
            self.auth.refund(prep.reservation, prep.reserved_tokens)
            raise
        self.affinity.served(prep.session, prep.prefix, call.backend)
        prep.headers[BACKEND_HEADER] = call.backend
        return call

    async def send(self, route_req: RouteRequest, path: str, body: bytes, rid: str) -> UpstreamCall:
        """POST `body` to the backend routing picks, once admitted (`admission.py`)."""
        return await self.admission.open(route_req, path, body, rid)

    async def _open_count(self, prep: Prepared) -> tuple[Prepared, UpstreamCall]:
        """`_open`, counting the prompt exactly while it waits for the backend (a callback
        that runs once `_open` yields, i.e. after the request went out); then the length
        check on the exact counts, which the bound makes a formality. `prep` comes back
        with the exact prompt count."""
        count = prep.count_later
        assert count is not None
        counted: list[list[int]] = []
        soon = asyncio.get_running_loop().call_soon(lambda: counted.append(count()))
        try:
            call = await self._open(prep)
        finally:
            soon.cancel()
        try:
            counts = counted[0] if counted else count()
        except BaseException:
            await call.aclose()  # the backend aborts the request
            raise
        prep.headers[PROMPT_TOKENS_HEADER] = count_header(counts)
        return replace(prep, prompt_tokens=sum(counts)), call

    # --- after the upstream answered ------------------------------------------
    def _observe(
        self,
        prep: Prepared,
        status: str,
        t0: float,
        ttft: float | None,
        usage: dict[str, Any] | None,
    ) -> None:
        e2e = time.perf_counter() - t0
        series = self.metrics.series(prep.model, prep.endpoint.label)
        series.duration(status).observe(e2e)
        # chat and completions name them prompt/completion_tokens; Responses input/output_tokens
        out = usage.get("completion_tokens", usage.get("output_tokens")) if usage else None
        if isinstance(out, int):
            series.output_tokens.observe(out)
            self.auth.refund(prep.reservation, prep.reserved_tokens - prep.prompt_tokens - out)
            prompt = usage.get("prompt_tokens", usage.get("input_tokens")) if usage else None
            self.auth.record_usage(
                prep.key, prompt if isinstance(prompt, int) else prep.prompt_tokens, out
            )
        if ttft is not None:
            series.ttft.observe(ttft)
            if isinstance(out, int) and out >= 2:
                series.tpot.observe((e2e - ttft) / (out - 1))

    async def _unary(self, prep: Prepared, call: UpstreamCall, t0: float) -> Response:
        raw = b""
        try:
            async for chunk in call.chunks():
                raw += chunk
        except GatewayError as e:
            kind = "timeout" if isinstance(e, UpstreamTimeout) else "broken_stream"
            self.metrics.upstream_errors.labels(call.backend, kind).inc()
            self._observe(prep, "502", t0, None, None)
            log.warning("request %s: %s: %s", prep.request_id, call.backend, e.message)
            return error_response(e, prep.request_id)
        finally:
            await call.aclose()
        usage = None
        try:
            parsed = json.loads(raw)
            usage = parsed.get("usage") if isinstance(parsed, dict) else None
        except ValueError:
            pass
        self._observe(prep, str(call.status), t0, None, usage)
        return Response(
            raw, status_code=call.status, media_type=call.content_type, headers=prep.headers
        )

    def _end_stream(self, prep: Prepared, call: UpstreamCall, t0: float, end: StreamEnd) -> None:
        """Once per stream (the relay calls it; synchronous, so no cancel can cut it
        short): metrics, then close the upstream (an unfinished response drops its
        connection: vLLM aborts the request)."""
        if end.error_kind is not None:
            self.metrics.upstream_errors.labels(call.backend, end.error_kind).inc()
            log.warning(
                "request %s: the stream from %s ended with %s",
                prep.request_id,
                call.backend,
                end.error_kind,
            )
        self._observe(prep, end.status, t0, end.ttft, end.usage)
        self.metrics.inflight.dec()
        call.close()
