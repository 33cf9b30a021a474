"""The client-side SSE decoder: events cut anywhere by the network, [DONE], bad data."""

from __future__ import annotations

import json

import pytest

from lorastack.sse import BadEvent, EventReader, chunk_text


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_events_come_out_whole_wherever_the_bytes_are_cut() -> None:
    chat = [{"choices": [{"delta": {"content": w}}]} for w in ("Hel", "lo", " ✓")]
    body = b": comment\n\n" + b"".join(_event(c) for c in chat) + b"data: [DONE]\n\n"
    for cut in range(1, len(body)):
        reader = EventReader()
        events = reader.feed(body[:cut]) + reader.feed(body[cut:])
        assert "".join(chunk_text(e) for e in events) == "Hello ✓", cut
        assert reader.done


def test_nothing_after_done_and_the_text_of_both_kinds() -> None:
    reader = EventReader()
    events = reader.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\ndata: {}\n\n')
    assert [chunk_text(e, chat=False) for e in events] == ["a"]
    assert reader.feed(_event({"choices": [{"text": "b"}]})) == []
    assert chunk_text({"choices": []}) == "" and chunk_text({"usage": {}}) == ""


def test_a_data_line_that_is_not_json_is_named() -> None:
    with pytest.raises(BadEvent, match="bad SSE data: b'not json'"):
        EventReader().feed(b"data: not json\n\n")


CHAT = [{"choices": [{"delta": {"content": w}}]} for w in ("Hel", "lo")]


def _stream(newline: bytes, space: bytes) -> bytes:
    """The same two chunks and [DONE], written with `newline` line ends and `space` after
    `data:` (both legal SSE), a comment, an `event:`/`id:` line and a data-less event."""
    lines = [b": keep-alive", b"", b"event: ping", b"id: 1", b""]
    for c in CHAT:
        lines += [b"data:" + space + json.dumps(c).encode(), b""]
    lines += [b"data:" + space + b"[DONE]", b"", b"data: {}", b""]
    return newline.join(lines) + newline


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("space", [b" ", b""], ids=["data: ", "data:"])
def test_every_legal_line_end_and_data_form_reads_the_same(newline: bytes, space: bytes) -> None:
    body = _stream(newline, space)
    for cut in range(len(body) + 1):  # every cut, a CRLF split between two reads too
        reader = EventReader()
        events = reader.feed(body[:cut]) + reader.feed(body[cut:])
        assert events == CHAT, (cut, body[:cut], body[cut:])
        assert reader.done  # `data:[DONE]` ends the stream as `data: [DONE]` does


def test_multi_line_data_is_joined_by_newline() -> None:
    reader = EventReader()
    body = b'data: {"choices": [{"delta":\ndata:  {"content": "a\\nb"}}]}\n\n'
    (event,) = reader.feed(body)
    assert chunk_text(event) == "a\nb"
    assert EventReader().feed(b'data:{"a":\r\ndata:1}\r\n\r\n') == [{"a": 1}]


def test_an_event_cut_off_by_the_end_of_the_stream_is_not_dispatched() -> None:
    reader = EventReader()
    assert reader.feed(b'data: {"a": 1}\n') == []  # no blank line yet: not an event
    assert reader.feed(b"\n") == [{"a": 1}]
