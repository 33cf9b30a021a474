"""Large bodies off the event loop (gateway.body_pool): where the work runs, the collector
paused while a large body's objects live and those objects freed on a worker thread; and,
over real HTTP, a large body answered exactly as a small one (the same 4xx for the same
fault, the same bytes forwarded), with the collector back on after every request."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_gateway_proxy import chat, wait_for

from gateway.body_pool import LARGE_BODY_BYTES, CollectorPause, LargeBody, run_for_body

PAD = "p" * (2 * LARGE_BODY_BYTES)  # a member that makes a body large


@pytest.fixture
def collector_on() -> Iterator[None]:
    assert gc.isenabled()
    yield
    wait_for(gc.isenabled, timeout=30)  # every pause ended (releases run on a worker)


def test_a_large_body_is_worked_on_off_the_loop() -> None:
    async def where(size: int) -> str:
        return await run_for_body(size, lambda: threading.current_thread().name)

    loop_thread = threading.current_thread().name
    assert asyncio.run(where(LARGE_BODY_BYTES)) == loop_thread
    assert asyncio.run(where(LARGE_BODY_BYTES + 1)).startswith("large")


class Freed:
    """Records the thread that frees it."""

    def __init__(self) -> None:
        self.thread: list[str] = []

    def __del__(self) -> None:
        self.thread.append(threading.current_thread().name)


def test_a_large_body_pauses_the_collector_and_is_freed_on_a_worker(collector_on: None) -> None:
    held = LargeBody()
    held.begin(LARGE_BODY_BYTES + 1)
    assert not gc.isenabled()
    obj = Freed()
    thread = obj.thread  # outlives obj
    held.keep(obj)
    del obj
    held.release()
    wait_for(lambda: bool(thread))
    assert thread[0].startswith("large")
    held.release()  # once only: a second call does nothing


def test_a_small_body_is_neither_kept_nor_pauses(collector_on: None) -> None:
    held = LargeBody()
    held.begin(LARGE_BODY_BYTES)
    assert gc.isenabled()
    obj = Freed()
    thread = obj.thread
    held.keep(obj)
    del obj
    assert thread == [threading.current_thread().name]  # freed here, at once
    held.release()


def test_the_pause_counts_its_holders_and_is_bounded(collector_on: None) -> None:
    now = [0.0]
    pause = CollectorPause(max_pause_s=10.0, clock=lambda: now[0])
    assert pause.enter() and pause.enter()
    pause.leave()
    assert not gc.isenabled()  # one holder left
    now[0] = 10.5
    assert not pause.enter()  # too late to join: the pause ends with the holder it has
    pause.leave()
    assert gc.isenabled()
    assert pause.enter()  # a new pause
    pause.leave()
    gc.disable()  # something else turned it off: left alone
    try:
        assert not pause.enter()
        assert not gc.isenabled()
    finally:
        gc.enable()


def padded(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with an unknown member after the others that makes it a large body."""
    return {**body, "metadata": {"pad": PAD}}


def test_a_large_body_is_answered_as_a_small_one(make_gateway, fake, collector_on: None) -> None:
    url, state = fake
    with make_gateway([url], max_body_bytes=4 * LARGE_BODY_BYTES, max_messages=3) as gw:
        post = f"{gw}/v1/chat/completions"
        for body in (chat(max_tokens=4), chat(max_tokens=4, stream=True)):
            r = httpx.post(post, json=padded(body))
            assert r.status_code == 200, r.text
            added = {"stream_options": {"include_usage": True}} if body.get("stream") else {}
            assert state.calls()[-1] == {**padded(body), **added}
        # the same fault in a small and a large body: the same status and message
        faults: list[tuple[dict[str, Any], int]] = [
            ({"model": "smollm2", "messages": []}, 400),
            (chat(max_tokens=0), 400),
            (chat(model="nope"), 404),
            (chat(messages=[{"role": "user", "content": "x"}] * 4), 400),
        ]
        for body, status in faults:
            small, large = (httpx.post(post, json=b) for b in (body, padded(body)))
            assert small.status_code == large.status_code == status, large.text
            assert small.json()["error"]["message"] == large.json()["error"]["message"]
        for broken in (b'{"model": "smollm2", "messages": [,', b'{"model": "smollm2" "x": 1'):
            small, large = (
                httpx.post(post, content=broken + pad, headers={"content-type": "application/json"})
                for pad in (b"", b" " + PAD.encode())
            )
            assert small.status_code == large.status_code == 400
            assert small.json()["error"]["message"] == large.json()["error"]["message"]
        # over the limit: refused from its length, and while it is read when it has none
        over = json.dumps(chat(metadata={"pad": "p" * 4 * LARGE_BODY_BYTES})).encode()
        assert httpx.post(post, content=over).status_code == 413
        assert httpx.post(post, content=iter([over[:1000], over[1000:]])).status_code == 413
        text = {"content-type": "text/plain"}
        assert httpx.post(post, content=json.dumps(padded(chat())), headers=text).status_code == 415
        # the bodies passed through as they are
        r = httpx.post(f"{gw}/tokenize", json=padded({"model": "smollm2", "prompt": "a b c"}))
        assert r.status_code == 200 and r.json()["count"] == 3, r.text
