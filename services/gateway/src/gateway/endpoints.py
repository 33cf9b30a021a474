"""The proxied generation endpoints as typed handlers: each one's path, metric label,
body parser, output-limit field and stream end, in one table (`ENDPOINTS`, by path).

Owns: what differs between /v1/chat/completions, /v1/completions and /v1/responses.
Does not own: the checks themselves (`validation.py`, `responses.py`), the request flow
(`proxy.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.responses import parse_responses
from gateway.sse import CHAT_END, RESPONSES_END
from gateway.validation import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    requested_output,
)

GenerationRequest = ChatRequest | CompletionRequest


def _parse_completion(body: dict[str, Any], max_messages: int) -> CompletionRequest:
    return parse_completion(body)  # a prompt, no messages to limit


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI route the gateway serves: its path, body parser and stream end."""

    label: str  # the route in metrics and logs
    path: str
    parse: Callable[[dict[str, Any], int], GenerationRequest]  # (body, max_messages)
    end: tuple[bytes, ...]  # the stream's last event (`sse.py`)
    always_usage: bool = False  # the stream's last event reports usage, asked or not
    output_param: str | None = None  # the output limit's name, where not vLLM's own

    def requested_output(self, req: GenerationRequest) -> tuple[str, int | None]:
        """The field that limits the output as the client named it, and its value (None =
        up to the context end)."""
        param, requested = requested_output(req)
        return self.output_param or param, requested

    def client_wants_usage(self, req: GenerationRequest) -> bool:
        """Whether the stream's last event must carry usage for the client."""
        return self.always_usage or bool((req.stream_options or {}).get("include_usage"))


CHAT = Endpoint("chat", "/v1/chat/completions", parse_chat, CHAT_END)
COMPLETION = Endpoint("completion", "/v1/completions", _parse_completion, CHAT_END)
# read as the chat request vLLM renders from it; the Responses API always reports usage
# (in its last event)
RESPONSES = Endpoint(
    "responses",
    "/v1/responses",
    parse_responses,
    RESPONSES_END,
    always_usage=True,
    output_param="max_output_tokens",
)
ENDPOINTS = {e.path: e for e in (CHAT, COMPLETION, RESPONSES)}
