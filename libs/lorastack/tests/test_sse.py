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
