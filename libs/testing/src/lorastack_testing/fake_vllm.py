"""The one fake vLLM (OpenAI-compatible server) for the tests and the benchmarks.

A plain ASGI app (no framework overhead to blur a benchmark), served on 127.0.0.1 by
uvicorn in a thread (`FakeServer`) or as its own process (`python -m
lorastack_testing.fake_vllm --port N`). Routes as vLLM 0.32 answers them: `/v1/models`
(max_model_len, parent for adapters), `/v1/chat/completions` and `/v1/completions`
(streamed as SSE, or one JSON answer), `/v1/responses` (the Responses API: one JSON
answer, or its typed events ending in `response.completed`), `/v1/embeddings` (only when
`embeds` is set, as vLLM mounts it only for an embedding model), `/metrics` in Prometheus
text with vLLM's names, `/health`. Everything it does is in `FakeState`, which a test may change at any time:

    answer      `tokens` (fixed pieces), or `answer(model, prompt text)` whose words are
                the tokens; `ignore_eos` (vLLM's extension) repeats them to max_tokens
    timing      the first content chunk `ttft_s` after the request got a running slot,
                each later one `pace_s` after the previous (an absolute schedule: no
                drift); `first_byte_delay_s` before the response starts
    queueing    at most `max_running` requests generate at once (0: no limit); the others
                wait, reported as vllm:num_requests_waiting
    tokenize    `/tokenize` and `/detokenize` (vLLM's extension): one token per word
    LoRAs       `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's runtime API,
                VLLM_ALLOW_RUNTIME_LORA_UPDATING): a loaded adapter joins `models` with
                its path as `root` and the first model as `parent`; a name already
                loaded is refused (400) unless `load_inplace`, an unknown unload is 404
    embeddings  `embeds`: /v1/embeddings answers a 4-float vector per input (float or
                base64, as the `openai` client asks); unset, the route is a 404
    failures    an HTTP error before the first byte (`fail_status` for `fail_count`
                requests, or every `fail_every`th), a connection that dies mid-stream
    metrics     the gauges set in the state, plus the requests generating and waiting now;
                KV-cache usage is `kv_per_request` per generating request when that is set
    records     every request body received (and its headers), streams completed and cancelled by the client
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from lorastack_testing.fake_metrics import metrics_text
from lorastack_testing.net import serve_in_thread

AnswerFn = Callable[[str, str], str]  # (model, prompt text) -> answer text


def echo_answer(model: str, prompt: str) -> str:
    return prompt


def write_upper_case_task(path: Path, n: int) -> Path:
    """A test split of `n` chats 'wordI' -> 'WORDI': a model whose `answer` upper-cases the
    prompt scores 1 on it, one that echoes it (`echo_answer`) scores 0."""
    from lorastack.chat_data import Conversation, write_jsonl

    convs = [
        Conversation.model_validate(
            {"messages": [{"role": "user", "content": f"word{i}"},
                          {"role": "assistant", "content": f"WORD{i}"}]}
        )
        for i in range(n)
    ]  # fmt: skip
    write_jsonl(path, convs)
    return path


@dataclass
class FakeState:
    models: list[dict[str, Any]] = field(
        default_factory=lambda: [{"id": "smollm2", "max_model_len": 2048}]
    )
    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!", " Bye", "."])
    answer: AnswerFn | None = None  # set: its words are the tokens (instead of `tokens`)
    ttft_s: float = 0.0  # seconds from a running slot to the first content chunk
    pace_s: float = 0.0  # seconds between content chunks
    first_byte_delay_s: float = 0.0  # seconds before the response starts
    max_running: int = 0  # requests generating at once; 0 = no limit
    fail_status: int | None = None  # answer this status (before any byte) ...
    fail_count: int = 0  # ... to this many requests, then serve normally
    fail_every: int = 0  # answer every Nth completion request with HTTP 500 (0: never)
    die_after_tokens: int | None = None  # kill the connection after this many tokens
    prompt_tokens: int | None = 10  # what usage reports; None: the prompt's words
    send_usage: bool = True  # honour stream_options.include_usage
    embeds: bool = False  # serve /v1/embeddings (an embedding model)
    # /metrics values (added to what the fake itself is doing)
    kv_usage: float = 0.0  # 0..1
    kv_per_request: float = 0.0  # when > 0: KV usage = this x requests generating
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
    received_headers: list[dict[str, str]] = field(default_factory=list)  # one per `received`
    cancelled: int = 0  # streams whose client went away before the end
    completed: int = 0
    active: int = 0  # streams being served now
    generating: int = 0  # requests holding a running slot now
    queued: int = 0  # requests waiting for one
    waited: int = 0  # requests that found every running slot taken (and queued)

    def calls(self, path: str = "") -> list[dict[str, Any]]:
        return [body for p, body in self.received if p.endswith(path)]


def _text(content: Any) -> str:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text": ...}]."""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def plan_answer(s: FakeState, body: dict[str, Any], chat: bool) -> tuple[list[str], str, int]:
    """(the streamed pieces, finish_reason, prompt tokens) for one request body."""
    if chat:
        users = [
            _text(m.get("content")) for m in body.get("messages", []) if m.get("role") == "user"
        ]
        prompt = users[-1] if users else ""
    else:
        prompt = str(body.get("prompt", ""))
    if s.answer is None:
        source = list(s.tokens)
    else:
        words = s.answer(str(body.get("model", "")), prompt).split()
        source = [w if i == 0 else " " + w for i, w in enumerate(words)]
    wanted = body.get("max_completion_tokens") if chat else None  # a chat-only field
    limit = wanted or body.get("max_tokens") or len(source)
    if body.get("ignore_eos"):  # exactly max_tokens tokens
        pieces = list(itertools.islice(itertools.cycle(source or ["x"]), limit))
        finish = "length"
    else:
        pieces = source[:limit]
        finish = "length" if limit < len(source) else "stop"
    prompt_tokens = len(prompt.split()) if s.prompt_tokens is None else s.prompt_tokens
    return pieces, finish, prompt_tokens


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


ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def lora_update(s: FakeState, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """vLLM 0.32's answers to a runtime LoRA load or unload, applied to `s.models`."""
    name = body.get("lora_name")
    loaded = {m["id"]: m for m in s.models if m.get("parent")}
    if path.endswith("unload_lora_adapter"):
        if name not in loaded:
            message = f"The lora adapter '{name}' cannot be found."
            return 404, _error(404, message, "NotFoundError")
        s.models.remove(loaded[name])
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode()
    if not name or not body.get("lora_path"):
        message = "Both 'lora_name' and 'lora_path' must be provided."
        return 400, _error(400, message, "InvalidUserInput")
    if name in loaded and not body.get("load_inplace"):
        message = f"The lora adapter '{name}' has already been loaded."
        return 400, _error(400, message, "InvalidUserInput")
    card = {"id": name, "root": body["lora_path"], "parent": s.models[0]["id"]}
    if name in loaded:
        loaded[name].update(card)
    else:
        s.models.append(card)
    return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()


def _tokenize(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize and /detokenize answers, with one token (id = length) per word."""
    if path == "/detokenize":
        return {"prompt": " ".join("w" * t for t in body.get("tokens", []))}
    if "messages" in body:
        text = " ".join(_text(m.get("content")) for m in body["messages"])
    else:
        text = str(body.get("prompt", ""))
    tokens = [len(w) for w in text.split()]
    return {"count": len(tokens), "max_model_len": 2048, "tokens": tokens, "token_strs": None}


def _embeddings(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /v1/embeddings answer: a 4-float vector per input, from its words."""
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else list(inputs or [])
    data = []
    for i, text in enumerate(texts):
        words = str(text).split()
        vector = [float(len(words)), float(len(str(text))), 0.5, -1.0]
        encoded: Any = vector
        if body.get("encoding_format") == "base64":
            encoded = base64.b64encode(struct.pack("<4f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(len(str(t).split()) for t in texts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "model": body.get("model"), "data": data, "usage": usage}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    err = {"message": message, "type": type_, "param": param, "code": status}
    return json.dumps({"error": err}).encode()


class FakeVLLM:
    """The ASGI app; `state` may be changed by a test at any time."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        self._n = 0
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method, s = scope["path"], scope["method"], self.state
        if method == "GET" and path == "/v1/models":
            data = [
                {"object": "model", "owned_by": "vllm", "root": None, "parent": None, **m}
                for m in s.models
            ]
            return await _send(send, 200, json.dumps({"object": "list", "data": data}).encode())
        if method == "GET" and path == "/metrics":
            if s.metrics_down:
                return await _send(send, 500, b"down", "text/plain")
            return await _send(send, 200, metrics_text(s), "text/plain; version=0.0.4")
        if method == "GET" and path == "/health":
            return await _send(send, 200, b"")
        if method != "POST" or path not in ROUTES + LORA_ROUTES:
            return await _send(send, 404, b'{"error":{"message":"not found"}}')
        if path == "/v1/embeddings" and not s.embeds:  # vLLM mounts it for embedding models
            return await _send(send, 404, b'{"error":{"message":"not found"}}')
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = json.loads(raw)
        s.received.append((path, body))
        s.received_headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if path in LORA_ROUTES:
            status, answer = lora_update(s, path, body)
            return await _send(
                send, status, answer, "application/json" if status != 200 else "text/plain"
            )
        if path in ("/tokenize", "/detokenize"):
            return await _send(send, 200, json.dumps(_tokenize(path, body)).encode())
        if path == "/v1/embeddings":
            if "input" not in body:  # vLLM's schema check
                error = _error(400, "input: Field required", "BadRequestError", "input")
                return await _send(send, 400, error)
            return await _send(send, 200, json.dumps(_embeddings(body)).encode())
        if s.first_byte_delay_s:
            await asyncio.sleep(s.first_byte_delay_s)
        if s.fail_status is not None and s.fail_count > 0:
            s.fail_count -= 1
            error = _error(s.fail_status, f"fake failure {s.fail_status}", "InternalServerError")
            return await _send(send, s.fail_status, error)
        if s.fail_every and len(s.received) % s.fail_every == 0:
            return await _send(send, 500, _error(500, "scripted failure", "InternalServerError"))
        if body.get("model") not in [m["id"] for m in s.models]:
            message = f"The model `{body.get('model')}` does not exist."
            return await _send(send, 404, _error(404, message, "NotFoundError", "model"))
        if path == "/v1/responses":
            return await self._responses(receive, send, body)
        chat = path.endswith("chat/completions")
        limit = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
        if limit is not None and (type(limit) is not int or limit < 1):  # vLLM's schema says no
            message = f"max_tokens must be a positive integer, not {limit!r}"
            return await _send(send, 400, _error(400, message, "BadRequestError", "max_tokens"))
        pieces, finish, prompt_tokens = plan_answer(s, body, chat)
        self._n += 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(pieces),
            "completion_tokens": len(pieces),
        }
        if body.get("stream"):
            return await self._stream(receive, send, chat, body, pieces, finish, usage)
        async with self._slot():
            start = time.perf_counter()
            if pieces:
                due = start + s.ttft_s + (len(pieces) - 1) * s.pace_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
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
        return await _send(send, 200, json.dumps(out).encode())

    async def _responses(self, receive: Any, send: Any, body: dict[str, Any]) -> None:
        """The Responses API: the answer as chat's, shaped as a response object (or its
        events: created, one output_text.delta per piece, completed)."""
        s = self.state
        inp = body.get("input")
        if isinstance(inp, str):
            messages = [{"role": "user", "content": inp}]
        else:
            messages = [m for m in inp or [] if isinstance(m, dict) and "role" in m]
        chat_body = {"messages": messages, "max_tokens": body.get("max_output_tokens")}
        pieces, finish, prompt_tokens = plan_answer(s, chat_body, chat=True)
        self._n += 1
        rid = f"resp_fake{self._n}"
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(pieces),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + len(pieces),
        }

        def response(status: str, text: str, with_usage: bool) -> dict[str, Any]:
            content = [{"type": "output_text", "text": text, "annotations": []}]
            item: dict[str, Any] = {"type": "message", "id": f"msg_{self._n}"}
            item |= {"role": "assistant", "status": "completed", "content": content}
            return {
                "id": rid,
                "object": "response",
                "created_at": int(time.time()),
                "model": body["model"],
                "status": status,
                "output": [item] if text else [],
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "incomplete_details": (
                    {"reason": "max_output_tokens"} if status == "incomplete" else None
                ),
                "usage": usage if with_usage else None,
            }

        status = "incomplete" if finish == "length" else "completed"
        if not body.get("stream"):
            async with self._slot():
                await asyncio.sleep(s.ttft_s + max(0, len(pieces) - 1) * s.pace_s)
            out = response(status, "".join(pieces), True)
            return await _send(send, 200, json.dumps(out).encode())

        def event(kind: str, **fields: Any) -> bytes:
            data = json.dumps({"type": kind, "sequence_number": 0, **fields}, separators=(",", ":"))
            return f"event: {kind}\ndata: {data}\n\n".encode()

        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {
                "type": "http.response.body",
                "body": event("response.created", response=response("in_progress", "", False)),
                "more_body": True,
            }
        )
        async with self._slot():
            start = time.perf_counter()
            for i, piece in enumerate(pieces):
                await asyncio.sleep(max(0.0, start + s.ttft_s + i * s.pace_s - time.perf_counter()))
                delta = event(
                    "response.output_text.delta",
                    item_id=f"msg_{self._n}",
                    output_index=0,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
                await send({"type": "http.response.body", "body": delta, "more_body": True})
        done = event("response.completed", response=response(status, "".join(pieces), True))
        await send({"type": "http.response.body", "body": done, "more_body": False})
        s.completed += 1

    @contextlib.asynccontextmanager
    async def _slot(self) -> Any:
        """A running slot (queued while `max_running` requests generate)."""
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
        try:
            yield
        finally:
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
            async with self._slot():
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


async def _send(send: Any, status: int, body: bytes, ctype: str = "application/json") -> None:
    headers = [(b"content-type", ctype.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
def serve_fake(state: FakeState, port: int = 0) -> Iterator[str]:
    """`with serve_fake(state) as url:` the fake on loopback; `state` stays live."""
    with serve_in_thread(FakeVLLM(state), port) as url:
        yield url


def main() -> None:
    p = argparse.ArgumentParser(description="the fake vLLM, as a process (for benchmarks)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--echo", action="store_true", help="answer with the prompt's words (not t0 t1 ...)"
    )
    a = p.parse_args()
    state = FakeState(
        models=[{"id": a.model, "max_model_len": 8192}],
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
