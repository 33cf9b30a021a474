"""The one fake vLLM (OpenAI-compatible server) for the tests and the benchmarks.

A plain ASGI app (no framework overhead to blur a benchmark), served on 127.0.0.1 by
uvicorn in a thread (`FakeServer`) or as its own process (`python -m
lorastack_testing.fake_vllm --port N`). Routes as vLLM 0.32 answers them: `/v1/models`
(max_model_len, parent for adapters), `/v1/chat/completions` and `/v1/completions`
(streamed as SSE, or one JSON answer), `/v1/responses` (the Responses API: one JSON
answer, or its typed events ending in `response.completed`), `/v1/embeddings` (only when
`embeds` is set, as vLLM mounts it only for an embedding model), `/metrics` in Prometheus
text with vLLM's names, `/health`. Everything it does is in `FakeState`, which a test may
change at any time:

    answer      `tokens` (fixed pieces), or `answer(model, prompt text)` whose words are
                the tokens; `ignore_eos` (vLLM's extension) repeats them to max_tokens
    timing      the first content chunk `ttft_s` after the request got a running slot,
                each later one `pace_s` after the previous (an absolute schedule: no
                drift); `first_byte_delay_s` before the response starts
    queueing    at most `max_running` requests generate at once (0: no limit); the others
                wait, reported as vllm:num_requests_waiting
    tokenize    `/tokenize` and `/detokenize` (vLLM's extension): one token per word
    logprobs    `scorer`: completions of token ids with `logprobs` decode greedily by it
    LoRAs       `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's runtime API,
                VLLM_ALLOW_RUNTIME_LORA_UPDATING): a loaded adapter joins `models` with
                its path as `root` and the first model as `parent`; a name already
                loaded is refused (400) unless `load_inplace`, an unknown unload is 404
    embeddings  `embeds`: /v1/embeddings answers a 4-float vector per input (float or
                base64, as the `openai` client asks); unset, the route is a 404
    hold        `hold` (a threading.Event): each stream waits for it after its first token,
                so a test decides when open streams end
    failures    an HTTP error before the first byte (`fail_status` for `fail_count`
                requests, or every `fail_every`th), a connection that dies mid-stream
    metrics     the gauges set in the state, plus the requests generating and waiting now;
                KV-cache usage is `kv_per_request` per generating request when that is set
    records     every request body received (and its headers), streams completed, requests
                cancelled by the client

This module routes requests (a table: (method, path) -> handler) and generates (chat
and completions, streamed or whole, on running slots) and serves the app (`FakeServer`,
`serve_fake`, `main`). The state and the answer plan are lorastack_testing.fake_state,
the routes beside generation and the error body lorastack_testing.fake_routes, the
scripted failures lorastack_testing.fake_failures, the Responses API
lorastack_testing.fake_responses, the `/metrics` text lorastack_testing.fake_metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from lorastack_testing.fake_failures import before_first_byte
from lorastack_testing.fake_responses import serve_responses
from lorastack_testing.fake_routes import (
    NOT_FOUND,
    SIDE_ROUTES,
    FakeRequest,
    Handler,
    error_body,
    send_answer,
)
from lorastack_testing.fake_state import FakeState, echo_answer, plan_answer, score_completion
from lorastack_testing.net import serve_in_thread


async def _disconnect(receive: Any) -> None:
    """Return once the client has hung up (`http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _chunk(chat: bool, model: str, n: int, text: str | None, finish: str | None) -> bytes:
    if chat:
        delta: dict[str, Any] = (
            {"role": "assistant", "content": ""} if text is None else {"content": text}
        )
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None}
    choice["finish_reason"] = finish
    return _sse(
        {
            "id": f"fake-{n}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
    )


def _authorized(scope: Any, key: str) -> bool:
    want = f"Bearer {key}".encode()
    return any(k.lower() == b"authorization" and v == want for k, v in scope["headers"])


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Any) -> bytes:
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return raw


class FakeVLLM:
    """The ASGI app; `state` may be changed by a test at any time."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        self._n = 0
        self._slots: asyncio.Semaphore | None = None
        complete = self._generation(self._complete)
        # (method, path) -> handler; any other is vLLM's 404
        self.routes: dict[tuple[str, str], Handler] = {
            **SIDE_ROUTES,
            ("POST", "/v1/chat/completions"): complete,
            ("POST", "/v1/completions"): complete,
            ("POST", "/v1/responses"): self._generation(self._responses),
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        path, method, s = scope["path"], scope["method"], self.state
        auth = tuple(v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization")
        s.authorizations.append((path, auth))
        if s.api_key is not None and path.startswith("/v1") and not _authorized(scope, s.api_key):
            # as vLLM's AuthenticationMiddleware: every /v1/* route, load_lora_adapter too
            return await send_answer(send, 401, b'{"error":"Unauthorized"}')
        handler = self.routes.get((method, path))
        if handler is None or (path == "/v1/embeddings" and not s.embeds):
            # vLLM mounts /v1/embeddings only for embedding models
            return await send_answer(send, 404, NOT_FOUND)
        body: dict[str, Any] = {}
        if method == "POST":
            body = json.loads(await _read_body(receive))
            s.received.append((path, body))
            s.received_headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await handler(s, FakeRequest(path, body, receive, send))

    # --- generation ---------------------------------------------------------------
    def _generation(self, serve: Handler) -> Handler:
        """`serve` after the scripted failures (fake_failures) and vLLM's model check."""

        async def handler(s: FakeState, req: FakeRequest) -> None:
            failure = await before_first_byte(s)
            if failure is not None:
                return await send_answer(req.send, *failure)
            model = req.body.get("model")
            if model not in [m["id"] for m in s.models]:
                message = f"The model `{model}` does not exist."
                error = error_body(404, message, "NotFoundError", "model")
                return await send_answer(req.send, 404, error)
            await serve(s, req)

        return handler

    async def _responses(self, s: FakeState, req: FakeRequest) -> None:
        self._n += 1
        await serve_responses(s, req.send, req.body, self._n, self._slot)

    async def _complete(self, s: FakeState, req: FakeRequest) -> None:
        """Chat and completions: streamed as SSE, or one JSON answer."""
        body, send = req.body, req.send
        chat = req.path.endswith("chat/completions")
        limit = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
        if limit is not None and (type(limit) is not int or limit < 1):  # vLLM's schema says no
            message = f"max_tokens must be a positive integer, not {limit!r}"
            return await send_answer(
                send, 400, error_body(400, message, "BadRequestError", "max_tokens")
            )
        if not chat and s.scorer is not None and body.get("logprobs") is not None:
            return await send_answer(send, 200, json.dumps(score_completion(s, body)).encode())
        pieces, finish, prompt_tokens = plan_answer(s, body, chat)
        self._n += 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(pieces),
            "completion_tokens": len(pieces),
        }
        if body.get("stream"):
            return await self._stream(req.receive, send, chat, body, pieces, finish, usage)
        async with self._slot(usage["total_tokens"]):
            start = time.perf_counter()
            if pieces:
                due = start + s.ttft_s + (len(pieces) - 1) * s.pace_s
                wait = due - time.perf_counter()
                if wait > 0:
                    try:  # the client going away aborts the request, as in vLLM
                        await asyncio.wait_for(_disconnect(req.receive), wait)
                        s.cancelled += 1
                        return
                    except TimeoutError:
                        pass
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        out = {
            "id": f"fake-{self._n}",
            "object": "chat.completion" if chat else "text_completion",
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }
        await send_answer(send, 200, json.dumps(out).encode())

    @contextlib.asynccontextmanager
    async def _slot(self, tokens: int = 0) -> Any:
        """A running slot (queued while `max_running` requests generate), holding the KV
        blocks of `tokens` (prompt + answer) while it runs."""
        s = self.state
        if self._slots is None and s.max_running:
            self._slots = asyncio.Semaphore(s.max_running)
        s.queued += 1
        if self._slots is not None and self._slots.locked():
            s.waited += 1
        try:
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            s.queued -= 1
        s.generating += 1
        blocks = 0
        if s.num_gpu_blocks is not None:
            blocks = -(-tokens // s.block_size)
            if s.kv_blocks_used + blocks > s.num_gpu_blocks - 1:  # one is vLLM's null block
                s.preemptions += 1
        s.kv_blocks_used += blocks
        try:
            yield
        finally:
            s.kv_blocks_used -= blocks
            s.generating -= 1
            if self._slots is not None:
                self._slots.release()

    async def _stream(
        self,
        receive: Any,
        send: Any,
        chat: bool,
        body: dict[str, Any],
        pieces: list[str],
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
            headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with self._slot(usage["total_tokens"]):
                start = time.perf_counter()
                events = [_chunk(chat, model, n, None, None)] if chat else []
                for i, piece in enumerate(pieces):
                    if s.die_after_tokens is not None and i >= s.die_after_tokens:
                        raise ConnectionAbortedError("fake vLLM dies mid-stream (on purpose)")
                    last = i == len(pieces) - 1
                    events.append(_chunk(chat, model, n, piece, finish if last else None))
                    wait = start + s.ttft_s + i * s.pace_s - time.perf_counter()
                    if wait > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(gone.wait(), wait)
                    if gone.is_set():
                        s.cancelled += 1
                        return
                    more = {"type": "http.response.body", "body": b"".join(events)}
                    await send(more | {"more_body": True})
                    events = []
                    if i == 0 and s.hold is not None:  # the test says when the rest comes
                        await asyncio.to_thread(s.hold.wait)
            tail = b""
            wants_usage = (body.get("stream_options") or {}).get("include_usage")
            if wants_usage and s.send_usage:
                tail += _sse(
                    {
                        "id": f"fake-{n}",
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": int(time.time()),
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            end = {"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"}
            await send(end | {"more_body": False})
            s.completed += 1
        finally:
            s.active -= 1
            watcher.cancel()


class FakeServer:
    """The fake on loopback in a thread: `with FakeServer(ttft_s=0.1) as fake: fake.base_url`.

    Keyword arguments are `FakeState` fields (or pass `state`); `port` 0 takes a free one."""

    def __init__(self, state: FakeState | None = None, *, port: int = 0, **fields: Any) -> None:
        self.state = state or FakeState(**fields)
        self.port = port
        self.base_url = ""
        self._serving: contextlib.ExitStack | None = None

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every completion request body received, in order."""
        return [body for _, body in self.state.received]

    def __enter__(self) -> FakeServer:
        stack = contextlib.ExitStack()
        self.base_url = stack.enter_context(serve_in_thread(FakeVLLM(self.state), self.port))
        self._serving = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._serving is not None:
            self._serving.close()


@contextlib.contextmanager
def serve_fake(state: FakeState, port: int = 0, host: str = "127.0.0.1") -> Iterator[str]:
    """`with serve_fake(state) as url:` the fake on loopback; `state` stays live."""
    with serve_in_thread(FakeVLLM(state), port, host) as url:
        yield url


def main() -> None:
    """Run the fake vLLM as a process on `--port` (for benchmarks) until killed."""
    p = argparse.ArgumentParser(description="the fake vLLM, as a process (for benchmarks)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    p.add_argument("--model", nargs="+", default=["smollm2"], help="the models it serves")
    p.add_argument(
        "--echo", action="store_true", help="answer with the prompt's words (not t0 t1 ...)"
    )
    a = p.parse_args()
    state = FakeState(
        models=[{"id": m, "max_model_len": 8192} for m in a.model],
        tokens=[f" t{i}" for i in range(a.tokens)],
        answer=echo_answer if a.echo else None,
        ttft_s=a.ttft,
        pace_s=a.pace,
    )
    print(f"READY http://127.0.0.1:{a.port}", flush=True)
    uvicorn.run(
        FakeVLLM(state), host="127.0.0.1", port=a.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
