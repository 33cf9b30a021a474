"""Pure request checks: the fields the gateway reads, limits, and token arithmetic.

The body is otherwise passed to vLLM untouched (unknown fields included). Nothing
here does I/O; counting tokens is `tokens.py`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import BadRequest, ContextLengthExceeded
from lorastack.untrusted_json import schema_error


class Passthrough(BaseModel):
    """Base of the request schemas: unknown fields pass through, typed fields are strict."""

    # strict: the body goes to vLLM as sent, so a field the gateway reads must already
    # have its type ("max_tokens": "5" or 1.0 would pass here and fail, or differ, there)
    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(Passthrough):
    """One chat message: its role and content (other fields pass through)."""

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class CommonFields(Passthrough):
    """The fields chat and completion requests share and the gateway reads."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # output tokens
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=128)


class ChatRequest(CommonFields):
    """A /v1/chat/completions body, as far as the gateway reads it."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens, as in vLLM
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(CommonFields):
    """A /v1/completions body, as far as the gateway reads it."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's completions default
    add_special_tokens: bool = True


def first_error(e: ValidationError) -> BadRequest:
    """The BadRequest for a schema error: the first error's field and what is wrong."""
    where, what = schema_error(e)
    where = where or "body"
    return BadRequest(
        f"invalid request: {where}: {what}",
        "see the OpenAI API reference for this field",
        param=where,
    )


def parse_chat(body: dict[str, Any], max_messages: int) -> ChatRequest:
    """The chat request in `body`.

    Raises BadRequest for a schema error, more than `max_messages` messages, or both
    continue_final_message and add_generation_prompt set."""
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:
        raise first_error(e) from None
    if len(req.messages) > max_messages:
        raise BadRequest(
            f"the request has {len(req.messages)} messages; this gateway accepts at most"
            f" {max_messages}.",
            "drop or summarise older turns.",
            param="messages",
        )
    if (
        req.add_generation_prompt
        and req.continue_final_message
        and "add_generation_prompt" in (req.model_fields_set)
    ):
        raise BadRequest(
            "cannot set both continue_final_message and add_generation_prompt to true.",
            param="continue_final_message",
        )
    return req


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """The completion request in `body`; raises BadRequest for a schema error."""
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise first_error(e) from None


def requested_output(req: CommonFields) -> tuple[str, int | None]:
    """Which field limits the output, and its value (None = up to the context end)."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


@dataclass(frozen=True)
class TokenPlan:
    """A request's counted prompt tokens and the output limit sent to the backend."""

    prompt_tokens: int
    max_tokens: int  # output tokens the backend may produce; prompt + this <= max_model_len
    clamped_from: int | None  # the client's value when clamp mode lowered it


def plan_tokens(
    prompt_tokens: int, requested: int | None, max_model_len: int, *, clamp: bool, param: str
) -> TokenPlan:
    """Check prompt + output <= max_model_len (tokens); clamp lowers output to fit."""
    room = max_model_len - prompt_tokens  # tokens left for output
    if room < 1:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your"
            f" prompt has {prompt_tokens} tokens, which leaves no room for any output tokens.",
            f"Shorten the prompt to at most {max_model_len - 1} tokens (drop older messages"
            " or the system prompt).",
            param="messages",
        )
    if requested is None:
        return TokenPlan(prompt_tokens, room, None)
    if requested <= room:
        return TokenPlan(prompt_tokens, requested, None)
    if clamp:
        return TokenPlan(prompt_tokens, room, requested)
    raise ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested"
        f" {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the"
        " completion).",
        f"Set {param} to at most {room}, shorten the prompt by {prompt_tokens + requested - max_model_len}"
        " tokens, or send the header `X-Lorastack-Clamp: 1` to have the gateway lower"
        f" {param} for you.",
        param=param,
    )
