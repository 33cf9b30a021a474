"""The request flow of /v1/chat/completions, /v1/completions and /v1/responses (read as
the chat request vLLM renders from it: `responses.py`); `fail`, `read_json` and `send`
also serve the bodies passed through as they are (`passthrough.py`).

auth -> body limits -> parse -> model check (exists, and the key may use it) -> exact
token count -> length check (or clamp) -> per-key limits and budget -> route (admission control) -> upstream with retries ->
pass the response through (SSE chunk by chunk) -> metrics.

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
connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from gateway.affinity import SESSION_HEADER, Affinity, prefix_hashes, session_key
from gateway.auth import Authenticator, Key
from gateway.backends import Backends
from gateway.counting import count_prompts
from gateway.errors import (
    BadRequest,
    GatewayError,
    NoKvRoom,
    Overloaded,
    PayloadTooLarge,
    UnsupportedMediaType,
    UpstreamTimeout,
    as_gateway_error,
    error_response,
)
from gateway.metrics import GatewayMetrics
from gateway.relay import SseRelay, StreamEnd
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import request_id
from gateway.responses import parse_responses
from gateway.routing import RouteRequest, Thresholds, Weights, pick_backend
from gateway.settings import GatewaySettings
from gateway.sse import CHAT_END, RESPONSES_END
from gateway.upstream import Upstream, UpstreamCall
from gateway.validation import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    plan_tokens,
    requested_output,
)
from lorastack.errors import InvalidInput
from lorastack.untrusted_json import (
    BodyTooLarge,
    NotJson,
    body_over,
    check_body_head,
    loads_object,
)

log = logging.getLogger(__name__)

CLAMP_HEADER = b"x-lorastack-clamp"  # request: "1"/"true" turns clamp mode on
CLAMPED_HEADER = "X-Lorastack-Clamped-Max-Tokens"  # response: "<from>-><to>"
PROMPT_TOKENS_HEADER = "X-Lorastack-Prompt-Tokens"
BACKEND_HEADER = "X-Lorastack-Backend"
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "responses": "/v1/responses",
}


@dataclass
class Prepared:
    model: str
    route: str
    stream: bool
    client_wants_usage: bool
    body: bytes
    headers: dict[str, str]  # for the client
    key: Key
    reserved_tokens: int  # prompt + max output, taken from the key's tokens/min bucket
    prompt_tokens: int  # all prompts, as counted here
    adapter: bool
    request_id: str  # also in `headers` (for the client) and sent to the backend
    session: str | None  # the session key (affinity.py)
    prefix: tuple[bytes, ...]  # hashes of the prompt's leading blocks (affinity.py)
    # set when upper bounds proved the fit (prompt_tokens is then the bound until it runs):
    # the exact counts and their length check, run after forwarding
    count_later: Callable[[], list[int]] | None = None


INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


class HeaderFields:
    """A request's header fields by lower-case name (ASGI servers lower-case them), the
    first of a repeated one as Starlette's `request.headers.get` gives it: one dict built
    per request instead of a scan of the list per field read (and an exception per absent
    field, the common case for the optional ones)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = dict(reversed(raw))

    def get(self, name: bytes) -> str | None:
        value = self._raw.get(name)
        return None if value is None else value.decode("latin-1")


def header_fields(request: Request) -> HeaderFields:
    return HeaderFields(request.scope["headers"])


async def receive_body(receive: Receive, limit: int) -> bytes:
    """A request's body from its ASGI messages, as Starlette's `Request.stream()` reads
    them (ClientDisconnect when the client hangs up first); over `limit` bytes is an error
    at once, before the rest arrives."""
    raw = b""
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            raw += message.get("body", b"")
            if len(raw) > limit:
                raise body_over(limit)
            if not message.get("more_body", False):
                return raw
        elif kind == "http.disconnect":
            raise ClientDisconnect()


def with_include_usage(raw: bytes) -> bytes:
    """`raw` (a JSON object with members and no `stream_options`) with
    `"stream_options": {"include_usage": true}` as its first member: the bytes the client
    sent, spliced, instead of the parsed body serialised again."""
    start = raw.index(b"{") + 1
    return raw[:start] + INCLUDE_USAGE + b"," + raw[start:]


class Proxy:
    def __init__(
        self,
        settings: GatewaySettings,
        backends: Backends,
        upstream: Upstream,
        auth: Authenticator,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.backends = backends
        self.upstream = upstream
        self.auth = auth
        self.metrics = metrics
        self.thresholds = Thresholds(settings.admit_max_kv_usage, settings.admit_max_waiting)
        self.weights = Weights(prefix=settings.prefix_weight, session=settings.session_weight)
        self.affinity = Affinity(settings.affinity_table_size)

    async def handle(self, request: Request, route: str) -> Response:
        t0 = time.perf_counter()
        self.metrics.inflight.inc()
        done_here = True  # a streaming response takes the in-flight count over
        fields = header_fields(request)
        rid = request_id(fields.get(b"x-request-id"))
        key: Key | None = None
        try:
            key = self.auth.authenticate(fields.get(b"authorization"))
            prep = await self._prepare(request, fields, route, rid, key)
            call = await (self._open(prep) if prep.count_later is None else self._open_count(prep))
            if prep.stream:
                done_here = False
                return SseRelay(
                    call,
                    prep.headers,
                    keep_usage=prep.client_wants_usage,
                    t0=t0,
                    request_id=rid,
                    on_end=lambda end: self._end_stream(prep, call, t0, end),
                    end=RESPONSES_END if route == "responses" else CHAT_END,
                )
            return await self._unary(prep, call, t0)
        except Exception as e:
            return self.fail(e, route, rid, key)
        finally:
            if done_here:
                self.metrics.inflight.dec()

    def fail(self, e: Exception, route: str, rid: str, key: Key | None) -> Response:
        """The one error exit of a proxied request: log line, rejection metric, response."""
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

    # --- before the upstream ------------------------------------------------
    async def read_json(
        self, request: Request, fields: HeaderFields | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """The body as a JSON object, and its bytes, within the limits (`untrusted_json`).
        Read from the ASGI messages and the header dict themselves: with Starlette's
        `stream()` (an async generator) and `headers` this took ~70 µs a request under the
        64-stream bench, ~40 µs without (bench/gateway/history.md)."""
        limit = self.settings.max_body_bytes
        fields = fields or header_fields(request)
        try:
            check_body_head(fields.get(b"content-type"), fields.get(b"content-length"), limit)
            raw = await receive_body(request.receive, limit)
            return loads_object(raw, max_depth=self.settings.max_json_depth), raw
        except BodyTooLarge as e:
            raise PayloadTooLarge(e.message, e.hint) from None
        except NotJson as e:
            raise UnsupportedMediaType(e.message, e.hint) from None
        except InvalidInput as e:
            raise BadRequest(e.message, e.hint) from None

    async def _prepare(
        self, request: Request, fields: HeaderFields, route: str, rid: str, key: Key
    ) -> Prepared:
        body, original = await self.read_json(request, fields)
        req: ChatRequest | CompletionRequest
        if route == "chat":
            req = parse_chat(body, self.settings.max_messages)
        elif route == "responses":
            req = parse_responses(body, self.settings.max_messages)
        else:
            req = parse_completion(body)
        self.auth.check_model(key, req.model)  # before existence: a 403 or 404 tells nothing
        info = await self.backends.model(req.model, key.models)
        max_len = self.backends.max_model_len(info)
        tok = await self.backends.tokenizer_for(info)
        param, requested = requested_output(req)
        if route == "responses":
            param = "max_output_tokens"
        exact_first = key.tokens is not None or key.budget is not None  # limits need it
        inputs, counts, count_later = await count_prompts(
            tok, req, requested, max_len, param, exact_first=exact_first, body_bytes=len(original)
        )
        clamp = self.settings.clamp_max_tokens or (fields.get(CLAMP_HEADER) or "").lower() in (
            "1",
            "true",
            "yes",
        )
        plans = [plan_tokens(c, requested, max_len, clamp=clamp, param=param) for c in counts]
        out_tokens = min(p.max_tokens for p in plans)  # one value serves every prompt
        headers = {REQUEST_ID_HEADER: rid}
        if count_later is None:
            headers[PROMPT_TOKENS_HEADER] = ",".join(str(c) for c in counts)
        changed = False
        if any(p.clamped_from is not None for p in plans):
            body[param] = out_tokens
            headers[CLAMPED_HEADER] = f"{requested}->{out_tokens}"
            self.metrics.clamped.inc()
            changed = True
        reserved = sum(counts) + out_tokens * req.n * len(counts)
        await self.auth.admit(key, reserved)
        # the Responses API always reports usage (in its last event)
        client_wants_usage = route == "responses" or bool(
            (req.stream_options or {}).get("include_usage")
        )
        raw = original
        if req.stream and not client_wants_usage:
            if changed or "stream_options" in body:
                changed = True
            else:  # the common case: one member to add, not the whole body to serialise again
                raw = with_include_usage(original)
            body["stream_options"] = {**(req.stream_options or {}), "include_usage": True}
        if changed:
            raw = json.dumps(body).encode()
        return Prepared(
            model=req.model,
            route=route,
            stream=req.stream,
            client_wants_usage=client_wants_usage,
            body=raw,
            headers=headers,
            key=key,
            reserved_tokens=reserved,
            prompt_tokens=sum(counts),
            adapter=info.parent is not None,
            request_id=rid,
            session=session_key(fields.get(SESSION_HEADER), body),
            prefix=self._prefix(inputs),
            count_later=count_later,
        )

    def _prefix(self, inputs: list[str | int]) -> tuple[bytes, ...]:
        """The prefix hashes of the first prompt (a token-id prompt has none)."""
        if self.weights.prefix <= 0 or not inputs or not isinstance(inputs[0], str):
            return ()
        return prefix_hashes(inputs[0])

    async def _open(self, prep: Prepared) -> UpstreamCall:
        route_req = self.affinity.route_request(prep.model, prep.adapter, prep.session, prep.prefix)
        # its KV claim: prompts (the bound, while counted later) + max output of every choice
        route_req = replace(route_req, tokens=prep.reserved_tokens)
        path = PATHS[prep.route]
        try:
            call = await self.send(route_req, path, prep.body, prep.request_id)
        except GatewayError:
            self.auth.refund(prep.key, prep.reserved_tokens)
            raise
        self.affinity.served(prep.session, prep.prefix, call.backend)
        prep.headers[BACKEND_HEADER] = call.backend
        return call

    async def send(self, route_req: RouteRequest, path: str, body: bytes, rid: str) -> UpstreamCall:
        """POST `body` to the backend routing picks (admission control, retries)."""
        interval = self.settings.scrape_interval_s

        def pick(tried: Collection[str]) -> str:
            return pick_backend(
                route_req,
                self.backends.views(),
                thresholds=self.thresholds,
                weights=self.weights,
                avoid=tried,
                retry_after_s=interval,
            )

        headers = {"content-type": "application/json", "x-request-id": rid}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.kv_admit_wait_s
        rescraped = False
        while True:
            try:
                return await self.upstream.open(pick, path, body, headers, route_req.tokens)
            except NoKvRoom:
                # no KV room anywhere yet: wait for a request to end (bounded), then look
                # again; vLLM would have queued it too, but here it cannot evict another
                left = deadline - loop.time()
                if left <= 0:
                    raise
                await self.backends.inflight.released(left)
            except Overloaded:
                # saturated by the last scrape, which may be up to scrape_interval_s old (on
                # the H200, a burst that had just ended refused all 64 of the next): read
                # the backends once more before refusing (refresh() shares one read at once)
                if rescraped:
                    raise
                rescraped = True
                await self.backends.refresh()

    async def _open_count(self, prep: Prepared) -> UpstreamCall:
        """`_open`, counting the prompt exactly while it waits for the backend (a callback
        that runs once `_open` yields, i.e. after the request went out); then the length
        check on the exact counts, which the bound makes a formality."""
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
        prep.headers[PROMPT_TOKENS_HEADER] = ",".join(str(c) for c in counts)
        prep.prompt_tokens = sum(counts)
        return call

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
        series = self.metrics.series(prep.model, prep.route)
        series.duration(status).observe(e2e)
        # chat and completions name them prompt/completion_tokens; Responses input/output_tokens
        out = usage.get("completion_tokens", usage.get("output_tokens")) if usage else None
        if isinstance(out, int):
            series.output_tokens.observe(out)
            self.auth.refund(prep.key, prep.reserved_tokens - prep.prompt_tokens - out)
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
