"""The streaming response: a backend's SSE stream relayed to the client as raw ASGI.

Owns: the send loop (what a backend read completes goes out as one `http.response.body`
message, as the bytes arrived: no re-encoding), the watch for the client's disconnect
(it cancels the relay at once, even while the backend is silent), the one SSE error
event when the backend fails mid-stream, and reporting how the stream ended, exactly
once, to `on_end` (which records metrics and closes the upstream: vLLM then aborts).
Does not own: SSE parsing (`sse.py`), timeouts (`upstream.py`), metrics (`proxy.py`).

Why not Starlette's StreamingResponse: per chunk it ran an async-generator chain and
three send wrappers, per request a task group; this loop is what remains of that
(bench/gateway/history.md has the CPU per request before and after).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, UpstreamBroken, UpstreamTimeout, sse_error_event
from gateway.sse import CHAT_END, EventScanner
from gateway.upstream import UpstreamCall


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How one relayed stream ended."""

    status: str  # "200"; "502": the backend failed mid-stream; "499": the client left
    ttft: float | None  # seconds from the request to the backend's first body bytes
    usage: dict[str, Any] | None  # the backend's usage event, if one came
    error_kind: str | None = None  # "timeout" | "broken_stream" when status is "502"


_LEFT = StreamEnd("499", None, None)


class SseRelay(Response):
    """An ASGI response that relays `call` (an open upstream SSE response)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        call: UpstreamCall,
        headers: dict[str, str],
        *,
        keep_usage: bool,
        t0: float,
        on_end: Callable[[StreamEnd], None],
        request_id: str | None = None,
        end: tuple[bytes, ...] = CHAT_END,
    ) -> None:
        self.status_code = 200
        self.background = None
        # as Starlette's init_headers makes them, without its general case
        self.raw_headers = [
            *[(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
            (b"cache-control", b"no-cache"),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]
        self._call = call
        self._keep_usage = keep_usage
        self._t0 = t0
        self._on_end = on_end
        self._request_id = request_id  # for the error event
        self._end = end  # how the stream's last event starts (sse.py)
        self._ttft: float | None = None  # set by the relay at the first body bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scanner = EventScanner(keep_usage=self._keep_usage, end=self._end)
        end = _LEFT  # until the relay says otherwise
        task = asyncio.current_task()
        assert task is not None
        left: list[bool] = []  # the watcher appends once the client has hung up
        watcher = asyncio.create_task(cancel_on_disconnect(receive, task, left))
        try:
            end = await self._relay(send, scanner)
        except asyncio.CancelledError:
            # the watcher's cancel is the client leaving: a 499, not an error; any other
            # cancel (the server stopping) goes on after on_end
            if not left or task.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            if end.status == "499":  # the client left (or the server is stopping)
                end = StreamEnd("499", self._ttft, scanner.usage)
            self._on_end(end)  # synchronous: no cancel can cut it short

    async def _relay(self, send: Send, scanner: EventScanner) -> StreamEnd:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            call = self._call
            read = call.read
            chunk = await read()
            if chunk:
                self._ttft = time.perf_counter() - self._t0
            last = b""
            while chunk:
                ready = scanner.feed(chunk)
                if scanner.done and call.at_end():
                    last = ready  # the body ended with this read: one write ends the response
                    break
                if ready:
                    await send({"type": "http.response.body", "body": ready, "more_body": True})
                chunk = await read()
            if not scanner.done:
                raise UpstreamBroken(
                    f"the backend {self._call.backend} ended the stream before its last event"
                )
            end = StreamEnd("200", self._ttft, scanner.usage)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except GatewayError as err:
            kind = "timeout" if isinstance(err, UpstreamTimeout) else "broken_stream"
            end = StreamEnd("502", self._ttft, scanner.usage, kind)
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error_event(err, self._request_id),
                    "more_body": False,
                }
            )
        return end


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any], left: list[bool]) -> None:
    """Wait for the client's `http.disconnect`, then cancel `task` (the relay's, or the
    proxy's while it waits for admission and a unary answer); `left` says the cancel is
    this one. A plain task cancel, not an anyio cancel scope: the scope cost
    ~3% of the gateway's CPU per streamed request (bench/gateway/history.md)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    left.append(True)
    task.cancel()
