"""The relay's byte-level pieces without a server: SSE event scanning and the one-timer
first-byte/idle watch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from gateway.sse import RESPONSES_END, EventScanner
from gateway.upstream import _Silence, _SilenceWatch


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DELTA = event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
USAGE_ONLY = event({"choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


def test_whole_events_pass_as_the_same_bytes() -> None:
    s = EventScanner(keep_usage=False)
    assert s.feed(DELTA) is DELTA  # no copy, no re-encoding
    assert s.feed(DELTA + DELTA) == DELTA + DELTA  # one read with two events: one write
    assert not s.done and s.usage is None


def typed(kind: str, obj: dict[str, object]) -> bytes:
    """A Responses API event: `event:` line, then the data."""
    data = json.dumps({"type": kind, **obj}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def test_a_responses_stream_ends_at_its_completed_event_with_the_usage_inside() -> None:
    usage = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    created = typed("response.created", {"response": {"status": "in_progress", "usage": None}})
    delta = typed("response.output_text.delta", {"delta": "hi"})
    completed = typed("response.completed", {"response": {"status": "completed", "usage": usage}})
    s = EventScanner(keep_usage=True, end=RESPONSES_END)
    stream = created + delta + completed
    out = b""
    for i in range(0, len(stream), 11):
        out += s.feed(stream[i : i + 11])
    assert out == stream and s.done and s.usage == usage
    chat = EventScanner(keep_usage=True)  # chat's scanner waits for [DONE]
    chat.feed(stream)
    assert not chat.done


def test_split_events_wait_for_their_end() -> None:
    s = EventScanner(keep_usage=False)
    stream = DELTA + DELTA + USAGE_ONLY + DONE
    out = b""
    for i in range(0, len(stream), 7):  # every 7 bytes, cutting events and markers apart
        ready = s.feed(stream[i : i + 7])
        assert ready == b"" or ready.endswith(b"\n\n")
        out += ready
    assert out == DELTA + DELTA + DONE  # the usage-only event the gateway added is dropped
    assert s.done and s.usage == USAGE


def test_usage_event_kept_when_the_client_asked() -> None:
    s = EventScanner(keep_usage=True)
    assert s.feed(DELTA + USAGE_ONLY + DONE) == DELTA + USAGE_ONLY + DONE
    assert s.done and s.usage == USAGE


def test_usage_on_an_event_with_choices_is_never_dropped() -> None:
    both = event({"choices": [{"index": 0, "delta": {}}], "usage": USAGE})
    s = EventScanner(keep_usage=False)
    assert s.feed(both) == both and s.usage == USAGE


def test_done_and_usage_inside_content_are_text_not_markers() -> None:
    tricky = event({"choices": [{"delta": {"content": 'data: [DONE] "usage":{'}}]})
    s = EventScanner(keep_usage=False)
    assert s.feed(tricky) == tricky
    assert not s.done and s.usage is None


class _Reader:
    def __init__(self) -> None:
        self.failed: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.failed = exc


class _Timer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _ClockLoop:
    """The three loop methods the watch uses, on a clock the test moves: no sleep, so
    a loaded machine cannot turn "faster than the limit" into "slower"."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[_Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        self._timers.append(_Timer(when, callback))
        return self._timers[-1]

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        return self.call_at(self.now + delay, callback)

    def advance(self, seconds: float) -> None:
        """Move the clock, running each timer that falls due on the way, in order."""
        until = self.now + seconds
        while due := [t for t in self._timers if t.when <= until and not t.cancelled]:
            timer = min(due, key=lambda t: t.when)
            self._timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = until


def _watch(limit: float) -> tuple[_Reader, _SilenceWatch, _ClockLoop]:
    reader, loop = _Reader(), _ClockLoop()
    return reader, _SilenceWatch(reader, limit, loop), loop  # type: ignore[arg-type]


def test_silence_watch_fires_only_while_waiting_for_the_backend() -> None:
    # waiting longer than the limit: fires with the limit in the error
    fired, watch, clock = _watch(0.05)
    watch.reading()
    clock.advance(0.12)
    assert isinstance(fired.failed, _Silence) and fired.failed.seconds == 0.05
    # a long first-byte limit, then a short idle limit: the idle limit applies
    idle, watch, clock = _watch(30.0)
    watch.reading()
    watch.got(0.05)
    watch.reading()
    clock.advance(0.12)
    assert isinstance(idle.failed, _Silence) and idle.failed.seconds == 0.05
    # chunks keep coming faster than the limit: never fires
    steady, watch, clock = _watch(0.05)
    for _ in range(8):
        watch.reading()
        clock.advance(0.02)
        watch.got(0.05)
    watch.stop()
    assert steady.failed is None
    # not reading (the caller is busy sending to a slow client): paused
    paused, watch, clock = _watch(0.05)
    watch.reading()
    watch.got(0.05)
    clock.advance(0.15)
    watch.stop()
    assert paused.failed is None
    # the limit counts from the last read, not from the timer's first check
    late, watch, clock = _watch(0.05)
    clock.advance(0.04)
    watch.reading()
    clock.advance(0.04)  # the timer checks at 0.05: 0.01 s of waiting, re-armed
    assert late.failed is None
    clock.advance(0.02)  # 0.06 s of waiting
    assert isinstance(late.failed, _Silence)


class _Call:
    """What the relay reads from: body reads, then b"" (an `UpstreamCall` stand-in)."""

    backend = "http://b"

    def __init__(self, reads: list[bytes], ended_with_last: bool) -> None:
        self.reads = list(reads)
        self.ended_with_last = ended_with_last  # the last read brought the body's end too

    async def read(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def at_end(self) -> bool:
        return self.ended_with_last and not self.reads


def _relay_messages(call: _Call) -> tuple[list[dict[str, object]], list[object]]:
    from gateway.relay import SseRelay

    sent: list[dict[str, object]] = []
    ends: list[object] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    relay = SseRelay(call, {}, keep_usage=False, t0=0.0, on_end=ends.append)  # type: ignore[arg-type]
    asyncio.run(relay({"type": "http"}, receive, send))  # type: ignore[arg-type]
    return sent, ends


def test_a_body_that_ends_with_its_last_events_takes_one_write_to_finish() -> None:
    sent, ends = _relay_messages(_Call([DELTA, USAGE_ONLY + DONE], ended_with_last=True))
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(DELTA, True), (DONE, False)]  # usage dropped, [DONE] ends the response
    assert [(e.status, e.usage) for e in ends] == [("200", USAGE)]  # type: ignore[attr-defined]
    # the body's end arriving in a read of its own: the same bytes, one more (empty) write
    sent, ends = _relay_messages(_Call([DELTA, USAGE_ONLY + DONE], ended_with_last=False))
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(DELTA, True), (DONE, True), (b"", False)]
    assert [e.status for e in ends] == ["200"]  # type: ignore[attr-defined]


def written(stream: bytes, newline: bytes, space: bytes) -> bytes:
    """`stream` (LF, `data: `) with other legal line ends and `data:` without the space."""
    return stream.replace(b"data: ", b"data:" + space).replace(b"\n", newline)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("space", [b" ", b""], ids=["data: ", "data:"])
def test_every_legal_line_end_and_data_form_ends_and_counts_the_same(
    newline: bytes, space: bytes
) -> None:
    """A backend may write CRLF or CR line ends and `data:[DONE]` (all legal SSE): the
    stream still ends at [DONE], its usage is read, the added usage event is dropped, and
    the client gets the same events (as LF lines) wherever the bytes were cut."""
    lf = DELTA + DELTA + USAGE_ONLY + DONE
    stream = written(lf, newline, space)
    for cut in range(1, len(stream)):  # a CRLF cut between two reads too
        s = EventScanner(keep_usage=False)
        out = s.feed(stream[:cut]) + s.feed(b"") + s.feed(stream[cut:])
        assert out == written(DELTA + DELTA + DONE, b"\n", space), cut
        assert s.done and s.usage == USAGE, cut


def test_multi_line_data_is_joined_by_newline_for_the_usage() -> None:
    compact = json.dumps(USAGE, separators=(",", ":")).encode()
    usage = b'data: {"choices": [],\ndata: "usage":' + compact + b"}\n\n"
    s = EventScanner(keep_usage=True)
    assert s.feed(usage + DONE) == usage + DONE
    assert s.usage == USAGE and s.done


def test_a_responses_stream_ends_at_event_without_the_space() -> None:
    s = EventScanner(keep_usage=True, end=RESPONSES_END)
    s.feed(b'event:response.completed\r\ndata:{"response":{"usage":null}}\r\n\r\n')
    assert s.done
