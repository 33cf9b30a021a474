"""The request the proxy forwards (`Prepared`), and the pure steps that build it from
the parsed body and the counted prompts: the output limit (length check or clamp), the
tokens to reserve, the client's headers and the body sent to the backend.

Owns: that arithmetic and the body rewrite. Does not own: reading, parsing or counting
(`request_body.py`, `endpoints.py`, `counting.py`), limits and I/O (`proxy.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.affinity import prefix_hashes
from gateway.auth import Key
from gateway.endpoints import Endpoint, GenerationRequest
from gateway.limits import Reservation
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.validation import plan_tokens

CLAMP_HEADER = b"x-lorastack-clamp"  # request: "1"/"true" turns clamp mode on
CLAMPED_HEADER = "X-Lorastack-Clamped-Max-Tokens"  # response: "<from>-><to>"
PROMPT_TOKENS_HEADER = "X-Lorastack-Prompt-Tokens"
BACKEND_HEADER = "X-Lorastack-Backend"
INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


@dataclass(frozen=True)
class Prepared:
    """A generation request ready to forward: the backend body, the client headers, the counted
    tokens, the key's reservation and what routing needs."""

    model: str
    endpoint: Endpoint
    stream: bool
    client_wants_usage: bool
    body: bytes  # for the backend
    # for the client; forwarding adds the backend's (and the counts, when counted later)
    headers: dict[str, str]
    key: Key
    reserved_tokens: int  # prompt + max output, taken from the key's tokens/min bucket
    kv_sequences: tuple[int, ...]  # prompt + max output of each sequence (the KV claim)
    reservation: Reservation  # what took them: the refund goes back there
    prompt_tokens: int  # all prompts, as counted here
    adapter: bool
    request_id: str  # also in `headers` (for the client) and sent to the backend
    session: str | None  # the session key (affinity.py)
    prefix: tuple[bytes, ...]  # hashes of the prompt's leading blocks (affinity.py)
    # set when upper bounds proved the fit (prompt_tokens is then the bound until it runs):
    # the exact counts and their length check, run after forwarding
    count_later: Callable[[], list[int]] | None = None


@dataclass(frozen=True)
class OutputPlan:
    """The output limit sent to the backend, and the client's value when it was clamped."""

    max_tokens: int  # output tokens of each choice; one value serves every prompt
    clamped_from: int | None  # the client's value when clamp mode lowered it


def wants_clamp(always: bool, header: str | None) -> bool:
    """Clamp mode: on for the whole gateway, or asked for by the request's header."""
    return always or (header or "").lower() in ("1", "true", "yes")


def plan_output(
    counts: list[int], requested: int | None, max_len: int, *, clamp: bool, param: str
) -> OutputPlan:
    """The length check of every prompt (tokens; `plan_tokens`), as one output limit."""
    plans = [plan_tokens(c, requested, max_len, clamp=clamp, param=param) for c in counts]
    out_tokens = min(p.max_tokens for p in plans)
    clamped = any(p.clamped_from is not None for p in plans)
    return OutputPlan(out_tokens, requested if clamped else None)


def reserved_tokens(counts: list[int], out: OutputPlan, n: int) -> int:
    """Tokens: every prompt, plus the max output of each of its `n` choices."""
    return sum(counts) + out.max_tokens * n * len(counts)


def kv_sequences(counts: list[int], out: OutputPlan, n: int) -> tuple[int, ...]:
    """Tokens, prompt + max output, of each sequence vLLM runs: `n` per prompt."""
    return tuple(count + out.max_tokens for count in counts for _ in range(n))


def count_header(counts: list[int]) -> str:
    """Token counts as a header value: comma-separated."""
    return ",".join(str(c) for c in counts)


def client_headers(rid: str, counts: list[int] | None, out: OutputPlan) -> dict[str, str]:
    """The response headers known before forwarding (`counts`: None while counted later)."""
    headers = {REQUEST_ID_HEADER: rid}
    if counts is not None:
        headers[PROMPT_TOKENS_HEADER] = count_header(counts)
    if out.clamped_from is not None:
        headers[CLAMPED_HEADER] = f"{out.clamped_from}->{out.max_tokens}"
    return headers


def with_include_usage(raw: bytes) -> bytes:
    """`raw` (a JSON object with members and no `stream_options`) with
    `"stream_options": {"include_usage": true}` as its first member: the bytes the client
    sent, spliced, instead of the parsed body serialised again."""
    start = raw.index(b"{") + 1
    return raw[:start] + INCLUDE_USAGE + b"," + raw[start:]


def forward_body(
    body: dict[str, Any],
    raw: bytes,
    req: GenerationRequest,
    *,
    param: str,
    out: OutputPlan,
    client_wants_usage: bool,
) -> bytes:
    """The bytes for the backend: `raw` as the client sent it, with the clamped output
    limit, and `stream_options.include_usage` on a stream (the gateway needs the output
    count for TPOT; the relay drops the usage event when the client did not ask)."""
    updates: dict[str, Any] = {}
    if out.clamped_from is not None:
        updates[param] = out.max_tokens
    if req.stream and not client_wants_usage:
        if not updates and "stream_options" not in body:
            # the common case: one member to add, not the whole body to serialise again
            return with_include_usage(raw)
        updates["stream_options"] = {**(req.stream_options or {}), "include_usage": True}
    return json.dumps({**body, **updates}).encode() if updates else raw


def prompt_prefix(inputs: list[str | int], prefix_weight: float) -> tuple[bytes, ...]:
    """The prefix hashes of the first prompt (a token-id prompt has none)."""
    if prefix_weight <= 0 or not inputs or not isinstance(inputs[0], str):
        return ()
    return prefix_hashes(inputs[0])
