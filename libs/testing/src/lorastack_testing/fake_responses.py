"""The fake vLLM's Responses API (`/v1/responses`): the answer planned as chat's
(lorastack_testing.fake_state.plan_answer), shaped as one response object, or streamed
as its typed events (`response.created`, one `response.output_text.delta` per piece,
`response.completed`) on the fake's timing and running slots.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from lorastack_testing.fake_routes import send_answer
from lorastack_testing.fake_state import FakeState, plan_answer

Slot = Callable[[], AbstractAsyncContextManager[Any]]  # the app's running slot (max_running)


async def serve_responses(
    s: FakeState, send: Any, body: dict[str, Any], n: int, slot: Slot
) -> None:
    """The Responses API: the answer as chat's, shaped as a response object (or its
    events: created, one output_text.delta per piece, completed)."""
    inp = body.get("input")
    if isinstance(inp, str):
        messages = [{"role": "user", "content": inp}]
    else:
        messages = [m for m in inp or [] if isinstance(m, dict) and "role" in m]
    chat_body = {"messages": messages, "max_tokens": body.get("max_output_tokens")}
    pieces, finish, prompt_tokens = plan_answer(s, chat_body, chat=True)
    rid = f"resp_fake{n}"
    usage = {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(pieces),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + len(pieces),
    }

    def response(status: str, text: str, with_usage: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}]
        item: dict[str, Any] = {"type": "message", "id": f"msg_{n}"}
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
        async with slot():
            await asyncio.sleep(s.ttft_s + max(0, len(pieces) - 1) * s.pace_s)
        out = response(status, "".join(pieces), True)
        return await send_answer(send, 200, json.dumps(out).encode())

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
    async with slot():
        start = time.perf_counter()
        for i, piece in enumerate(pieces):
            await asyncio.sleep(max(0.0, start + s.ttft_s + i * s.pace_s - time.perf_counter()))
            delta = event(
                "response.output_text.delta",
                item_id=f"msg_{n}",
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
            await send({"type": "http.response.body", "body": delta, "more_body": True})
    done = event("response.completed", response=response(status, "".join(pieces), True))
    await send({"type": "http.response.body", "body": done, "more_body": False})
    s.completed += 1
