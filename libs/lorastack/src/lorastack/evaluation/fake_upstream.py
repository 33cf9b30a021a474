"""A scripted OpenAI-compatible server with known timing, for tests and dry runs.

It answers on 127.0.0.1 like vLLM does: `/v1/models`, `/v1/chat/completions` and
`/v1/completions` (streamed as SSE, or whole), and `/metrics` in Prometheus text with
vLLM's gauge names. Timing is set, so a load tester can be checked against it:

    first content chunk   `ttft_s` after the request arrives (plus queueing, see below)
    each later chunk      `itl_s` after the previous one; one token per chunk
    output length         max_tokens when `ignore_eos` is true, else the answer's words
    concurrency           at most `max_running` requests generate at once; the rest wait
                          (reported as vllm:num_requests_waiting)

Answers come from `answer(model, prompt_text)`; the default echoes the last user text.

    with FakeUpstream(ttft_s=0.1, itl_s=0.02) as fake:
        httpx.post(fake.base_url + "/v1/chat/completions", json={...})
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

AnswerFn = Callable[[str, str], str]  # (model, prompt text) -> answer


def echo_answer(model: str, prompt: str) -> str:
    return prompt


def _text(content: Any) -> str:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text": ...}]."""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


class FakeUpstream:
    def __init__(
        self,
        *,
        ttft_s: float = 0.05,  # seconds, request arrival -> first content chunk
        itl_s: float = 0.01,  # seconds between content chunks
        models: tuple[str, ...] = ("fake-base", "fake-lora"),
        answer: AnswerFn = echo_answer,
        max_running: int = 1000,  # requests generating at once; more wait in a queue
        kv_per_request: float = 0.1,  # reported KV-cache usage per running request (0..1)
        send_usage: bool = True,  # honour stream_options.include_usage
        fail_every: int = 0,  # answer every Nth request with HTTP 500 (0: never)
        port: int = 0,
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.models = models
        self.answer = answer
        self.max_running = max_running
        self.kv_per_request = kv_per_request
        self.send_usage = send_usage
        self.fail_every = fail_every
        self.port = port
        self.requests: list[dict[str, Any]] = []  # every request body received
        self.running = 0
        self.waiting = 0
        self.preemptions = 0
        self._slots: asyncio.Semaphore | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # -- the app ---------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/health", lambda r: PlainTextResponse(""), methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def _metrics(self, request: Request) -> Response:
        kv = min(1.0, self.running * self.kv_per_request)
        text = (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{self.models[0]}"}} {kv}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.models[0]}"}} {self.running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{self.models[0]}"}} {self.waiting}\n'
            "# TYPE vllm:num_preemptions_total counter\n"
            f'vllm:num_preemptions_total{{model_name="{self.models[0]}"}} {float(self.preemptions)}\n'
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        users = [
            _text(m.get("content")) for m in body.get("messages", []) if m.get("role") == "user"
        ]
        return await self._generate(body, users[-1] if users else "", chat=True)

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        return await self._generate(body, str(body.get("prompt", "")), chat=False)

    async def _generate(self, body: dict[str, Any], prompt: str, *, chat: bool) -> Response:
        self.requests.append(body)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return JSONResponse(
                {"error": {"message": "scripted failure", "code": 500}}, status_code=500
            )
        model = str(body.get("model", ""))
        if model not in self.models:
            return JSONResponse(
                {"error": {"message": f"The model `{model}` does not exist.", "code": 404}},
                status_code=404,
            )
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        words = self.answer(model, prompt).split()
        if body.get("ignore_eos"):
            tokens = [words[i % len(words)] if words else "x" for i in range(max_tokens)]
            finish = "length"
        else:
            tokens = words[:max_tokens]
            finish = "length" if len(words) > max_tokens else "stop"
        pieces = [t if i == 0 else " " + t for i, t in enumerate(tokens)]
        usage = {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": len(pieces),
            "total_tokens": len(prompt.split()) + len(pieces),
        }
        if not body.get("stream"):
            await self._run(pieces)
            text = "".join(pieces)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return JSONResponse(
                {
                    "id": "fake",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        include_usage = (
            bool((body.get("stream_options") or {}).get("include_usage")) and self.send_usage
        )
        return StreamingResponse(
            self._stream(pieces, finish, usage if include_usage else None, model, chat),
            media_type="text/event-stream",
        )

    def _slots_sem(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        return self._slots

    async def _run(self, pieces: list[str]) -> None:
        async for _ in self._timed(pieces):
            pass

    async def _timed(self, pieces: list[str]) -> AsyncIterator[str]:
        """Yield each piece at its scripted time, holding a running slot meanwhile."""
        self.waiting += 1
        async with self._slots_sem():
            self.waiting -= 1
            self.running += 1
            try:
                start = time.perf_counter()
                for i, piece in enumerate(pieces):
                    due = start + self.ttft_s + i * self.itl_s  # absolute: no drift
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    yield piece
            finally:
                self.running -= 1

    async def _stream(
        self, pieces: list[str], finish: str, usage: dict[str, int] | None, model: str, chat: bool
    ) -> AsyncIterator[bytes]:
        def event(data: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(data)}\n\n".encode()

        obj = "chat.completion.chunk" if chat else "text_completion"
        first = True
        async for piece in self._timed(pieces):
            if chat:
                delta: dict[str, Any] = {"content": piece}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None}
            first = False
            yield event({"id": "fake", "object": obj, "model": model, "choices": [choice]})
        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        yield event({"id": "fake", "object": obj, "model": model, "choices": [last]})
        if usage is not None:
            yield event(
                {"id": "fake", "object": obj, "model": model, "choices": [], "usage": usage}
            )
        yield b"data: [DONE]\n\n"

    # -- lifecycle -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = uvicorn.Config(
            self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake upstream did not start")
            time.sleep(0.01)
        if self.port == 0:
            self.port = self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeUpstream:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
