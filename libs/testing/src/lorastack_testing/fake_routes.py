"""The fake vLLM's answers beside generation, as vLLM 0.32 gives them: runtime LoRA load
and unload (applied to `FakeState.models`), `/tokenize` and `/detokenize` (one token per
word), `/v1/embeddings` (a 4-float vector per input); and the shapes every route shares:
vLLM's error body and a whole answer written to ASGI; their handlers (`SIDE_ROUTES`,
with `/v1/models`, `/metrics` and `/health`). Routing requests to them, and generation,
is lorastack_testing.fake_vllm.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from lorastack_testing.fake_metrics import metrics_text
from lorastack_testing.fake_state import FakeState, message_text

NOT_FOUND = b'{"error":{"message":"not found"}}'


@dataclass(frozen=True)
class FakeRequest:
    """What a route's handler sees (besides the state)."""

    path: str
    body: dict[str, Any]  # a POST's JSON body, as received; {} for a GET
    receive: Any  # ASGI: a stream watches it for the client hanging up
    send: Any


Handler = Callable[[FakeState, FakeRequest], Awaitable[None]]


def lora_update(s: FakeState, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """vLLM 0.32's answers to a runtime LoRA load or unload, applied to `s.models`."""
    name = body.get("lora_name")
    loaded = {m["id"]: m for m in s.models if m.get("parent")}
    if path.endswith("unload_lora_adapter"):
        if name not in loaded:
            message = f"The lora adapter '{name}' cannot be found."
            return 404, error_body(404, message, "NotFoundError")
        s.models.remove(loaded[name])
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode()
    if not name or not body.get("lora_path"):
        message = "Both 'lora_name' and 'lora_path' must be provided."
        return 400, error_body(400, message, "InvalidUserInput")
    if name in loaded and not body.get("load_inplace"):
        message = f"The lora adapter '{name}' has already been loaded."
        return 400, error_body(400, message, "InvalidUserInput")
    card = {"id": name, "root": body["lora_path"], "parent": s.models[0]["id"]}
    if name in loaded:
        loaded[name].update(card)
    else:
        s.models.append(card)
    return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()


def tokenize(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize and /detokenize answers, with one token (id = length) per word."""
    if path == "/detokenize":
        return {"prompt": " ".join("w" * t for t in body.get("tokens", []))}
    if "messages" in body:
        text = " ".join(message_text(m.get("content")) for m in body["messages"])
    else:
        text = str(body.get("prompt", ""))
    tokens = [len(w) for w in text.split()]
    return {"count": len(tokens), "max_model_len": 2048, "tokens": tokens, "token_strs": None}


def embeddings(body: dict[str, Any]) -> dict[str, Any]:
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


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    """An OpenAI error body as vLLM writes it (the status as `code`)."""
    err = {"message": message, "type": type_, "param": param, "code": status}
    return json.dumps({"error": err}).encode()


async def send_answer(send: Any, status: int, body: bytes, ctype: str = "application/json") -> None:
    """Send a whole response (status, content type, body) over ASGI."""
    headers = [(b"content-type", ctype.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_models(s: FakeState, req: FakeRequest) -> None:
    """GET /v1/models: the state's model cards."""
    data = [
        {"object": "model", "owned_by": "vllm", "root": None, "parent": None, **m} for m in s.models
    ]
    await send_answer(req.send, 200, json.dumps({"object": "list", "data": data}).encode())


async def serve_metrics(s: FakeState, req: FakeRequest) -> None:
    """GET /metrics: the state's metrics, or a 500 while `metrics_down`."""
    if s.metrics_down:
        return await send_answer(req.send, 500, b"down", "text/plain")
    await send_answer(req.send, 200, metrics_text(s), "text/plain; version=0.0.4")


async def serve_health(s: FakeState, req: FakeRequest) -> None:
    """GET /health: 200, empty."""
    await send_answer(req.send, 200, b"")


async def serve_lora(s: FakeState, req: FakeRequest) -> None:
    """POST /v1/load_lora_adapter or /v1/unload_lora_adapter: change the served adapters."""
    status, answer = lora_update(s, req.path, req.body)
    ctype = "application/json" if status != 200 else "text/plain"
    await send_answer(req.send, status, answer, ctype)


async def serve_tokenize(s: FakeState, req: FakeRequest) -> None:
    """POST /tokenize or /detokenize: one token per word."""
    await send_answer(req.send, 200, json.dumps(tokenize(req.path, req.body)).encode())


async def serve_embeddings(s: FakeState, req: FakeRequest) -> None:
    """POST /v1/embeddings: a vector per input, or a 400 without `input`."""
    if "input" not in req.body:  # vLLM's schema check
        error = error_body(400, "input: Field required", "BadRequestError", "input")
        return await send_answer(req.send, 400, error)
    await send_answer(req.send, 200, json.dumps(embeddings(req.body)).encode())


# (method, path) -> handler, for every route beside generation
SIDE_ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "/v1/models"): serve_models,
    ("GET", "/metrics"): serve_metrics,
    ("GET", "/health"): serve_health,
    ("POST", "/v1/embeddings"): serve_embeddings,
    ("POST", "/tokenize"): serve_tokenize,
    ("POST", "/detokenize"): serve_tokenize,
    ("POST", "/v1/load_lora_adapter"): serve_lora,
    ("POST", "/v1/unload_lora_adapter"): serve_lora,
}
