"""A fake vLLM (OpenAI-compatible) server for the gateway's tests and benchmark.

A real HTTP server on 127.0.0.1 (uvicorn in a thread, or `python fake_upstream.py` as its
own process) serving `/v1/models` (with max_model_len, parent for adapters),
`/v1/chat/completions` and `/v1/completions` (streaming fixed tokens at a set pace, or
one JSON answer), and `/metrics` as Prometheus text with the values in `FakeState`.
Failures on demand: an HTTP error before the first byte, a slow first byte, a
connection that dies mid-stream. It records what it received and which streams the
client cancelled. A plain ASGI app: no framework overhead to blur the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


@dataclass
class FakeState:
    models: list[dict[str, Any]] = field(
        default_factory=lambda: [{"id": "smollm2", "max_model_len": 2048}]
    )
    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!", " Bye", "."])
    pace_s: float = 0.0  # seconds between streamed tokens
    first_byte_delay_s: float = 0.0  # seconds before the response starts
    fail_status: int | None = None  # answer this status (before any byte) ...
    fail_count: int = 0  # ... to this many requests, then serve normally
    die_after_tokens: int | None = None  # kill the connection after this many tokens
    prompt_tokens: int = 10  # what usage reports
    # /metrics values
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    max_lora: int = 1
    old_kv_name: bool = False  # emit vllm:gpu_cache_usage_perc instead (older vLLM)
    metrics_down: bool = False  # /metrics answers 500
    # records
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancelled: int = 0  # streams whose client went away before the end
    completed: int = 0
    active: int = 0  # streams being served now

    def calls(self, path: str = "") -> list[dict[str, Any]]:
        return [body for p, body in self.received if p.endswith(path)]


def _metrics_text(s: FakeState) -> bytes:
    r = CollectorRegistry()
    labels = {"model_name": s.models[0]["id"] if s.models else "none", "engine": "0"}
    names = list(labels)
    kv_name = "vllm:gpu_cache_usage_perc" if s.old_kv_name else "vllm:kv_cache_usage_perc"
    Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", names, registry=r).labels(
        **labels
    ).set(s.kv_usage)
    Gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        names,
        registry=r,
    ).labels(**labels).set(s.running)
    Gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        names,
        registry=r,
    ).labels(**labels).set(s.waiting)
    Counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        names,
        registry=r,
    ).labels(**labels).inc(s.preemptions)
    Gauge(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=r,
    ).labels(
        max_lora=str(s.max_lora),
        waiting_lora_adapters=",".join(s.waiting_adapters),
        running_lora_adapters=",".join(s.running_adapters),
    ).set(time.time())
    return generate_latest(r)


def _chunk(kind: str, model: str, i: int, text: str | None, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = (
            {"role": "assistant", "content": ""} if text is None else {"content": text}
        )
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": f"fake-{i}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class FakeUpstream:
    """The ASGI app; `state` may be changed by a test at any time."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        self._n = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, s = scope["path"], self.state
        if scope["method"] == "GET" and path == "/v1/models":
            data = [
                {"object": "model", "owned_by": "vllm", "root": None, "parent": None, **m}
                for m in s.models
            ]
            return await self._send(
                send, 200, json.dumps({"object": "list", "data": data}).encode()
            )
        if scope["method"] == "GET" and path == "/metrics":
            if s.metrics_down:
                return await self._send(send, 500, b"down", "text/plain")
            return await self._send(send, 200, _metrics_text(s), "text/plain; version=0.0.4")
        if scope["method"] == "GET" and path == "/health":
            return await self._send(send, 200, b"")
        if scope["method"] != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return await self._send(send, 404, b'{"error":{"message":"not found"}}')
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = json.loads(raw)
        s.received.append((path, body))
        if s.first_byte_delay_s:
            await asyncio.sleep(s.first_byte_delay_s)
        if s.fail_status is not None and s.fail_count > 0:
            s.fail_count -= 1
            err = {
                "error": {
                    "message": f"fake failure {s.fail_status}",
                    "type": "InternalServerError",
                    "param": None,
                    "code": s.fail_status,
                }
            }
            return await self._send(send, s.fail_status, json.dumps(err).encode())
        names = [m["id"] for m in s.models]
        if body.get("model") not in names:
            err = {
                "error": {
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
            return await self._send(send, 404, json.dumps(err).encode())
        kind = "chat" if path.endswith("chat/completions") else "completion"
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or len(s.tokens)
        toks = s.tokens[:limit]
        finish = "length" if limit < len(s.tokens) else "stop"
        self._n += 1
        usage = {
            "prompt_tokens": s.prompt_tokens,
            "total_tokens": s.prompt_tokens + len(toks),
            "completion_tokens": len(toks),
        }
        if not body.get("stream"):
            if kind == "chat":
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(toks)},
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": "".join(toks), "finish_reason": finish}
            out = {
                "id": f"fake-{self._n}",
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "model": body["model"],
                "choices": [choice],
                "usage": usage,
            }
            return await self._send(send, 200, json.dumps(out).encode())
        await self._stream(receive, send, kind, body, toks, finish, usage)

    async def _stream(
        self,
        receive: Any,
        send: Any,
        kind: str,
        body: dict[str, Any],
        toks: list[str],
        finish: str,
        usage: dict[str, Any],
    ) -> None:
        s, n, model = self.state, self._n, body["model"]
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        s.active += 1
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
                }
            )
            events = (
                [_sse(_chunk(kind, model, n, None if kind == "chat" else "", None))]
                if kind == "chat"
                else []
            )
            for i, tok in enumerate(toks):
                if s.die_after_tokens is not None and i >= s.die_after_tokens:
                    raise ConnectionAbortedError("fake upstream dies mid-stream (on purpose)")
                last = i == len(toks) - 1
                events.append(_sse(_chunk(kind, model, n, tok, finish if last else None)))
                if s.pace_s and i:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(), s.pace_s)
                if gone.is_set():
                    s.cancelled += 1
                    return
                await send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
                events = []
            tail = b""
            if (body.get("stream_options") or {}).get("include_usage"):
                tail += _sse(
                    {
                        "id": f"fake-{n}",
                        "object": "chat.completion.chunk",
                        "created": int(time.time()),
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            await send(
                {
                    "type": "http.response.body",
                    "body": tail + b"data: [DONE]\n\n",
                    "more_body": False,
                }
            )
            s.completed += 1
        finally:
            s.active -= 1
            watcher.cancel()

    @staticmethod
    async def _send(send: Any, status: int, body: bytes, ctype: str = "application/json") -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int) -> Iterator[str]:
    """Run an ASGI app with uvicorn on 127.0.0.1:port in a thread; yields its base URL."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="critical",
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description="a fake vLLM for benchmarks")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--model", default="smollm2")
    a = p.parse_args()
    state = FakeState(
        models=[{"id": a.model, "max_model_len": 8192}],
        tokens=[f" t{i}" for i in range(a.tokens)],
        pace_s=a.pace,
    )
    uvicorn.run(
        FakeUpstream(state), host="127.0.0.1", port=a.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
