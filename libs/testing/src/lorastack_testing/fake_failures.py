"""The fake vLLM's scripted failures before a generation answers: the delay before the
first byte, then an HTTP error for `fail_count` requests (`fail_status`) or for every
`fail_every`th request received. (A connection that dies mid-stream, `die_after_tokens`,
is the stream's own: lorastack_testing.fake_vllm.)

Owns: when a generation request fails, and with what. Does not own: routing (fake_vllm)
or the state's fields (fake_state).
"""

from __future__ import annotations

import asyncio

from lorastack_testing.fake_routes import error_body
from lorastack_testing.fake_state import FakeState


def scripted_failure(s: FakeState) -> tuple[int, bytes] | None:
    """The status and error body this request fails with, if it is scripted to fail (one
    of `fail_count` is used up)."""
    if s.fail_status is not None and s.fail_count > 0:
        s.fail_count -= 1
        return s.fail_status, error_body(
            s.fail_status, f"fake failure {s.fail_status}", "InternalServerError"
        )
    if s.fail_every and len(s.received) % s.fail_every == 0:
        return 500, error_body(500, "scripted failure", "InternalServerError")
    return None


async def before_first_byte(s: FakeState) -> tuple[int, bytes] | None:
    """Wait `first_byte_delay_s` (seconds), then the scripted failure, if any."""
    if s.first_byte_delay_s:
        await asyncio.sleep(s.first_byte_delay_s)
    return scripted_failure(s)
