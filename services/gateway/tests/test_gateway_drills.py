"""Fault drill: the backend process is SIGKILLed in the middle of a stream.

The fake vLLM runs as its own process (`python -m lorastack_testing.fake_vllm`), the way vLLM runs
beside the gateway. What the client keeps: the tokens it already got, then one SSE error
event and a close WITHOUT `data: [DONE]` (its answer is cut off, not complete), well
within the idle timeout; the gateway marks the backend down (503s that say so, not 500s
or hangs) and serves again once the backend is back on the same address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from test_gateway_proxy import ADMIN, ADMIN_KEY, chat, sse_events, wait_for

from lorastack_testing.net import free_port

FAKE = [sys.executable, "-m", "lorastack_testing.fake_vllm"]
# far above how long noticing the kill takes, however loaded the machine (was 5 s): the
# event says upstream_broken, so the break, not this timeout, ended the stream
IDLE_TIMEOUT_S = 30.0


def _start_fake(port: int, pace_s: float = 0.02) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [*FAKE, "--port", str(port), "--tokens", "400", "--pace", str(pace_s)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the fake did not start"
        time.sleep(0.05)


@pytest.fixture
def fake_process() -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    port = free_port()
    # 400 tokens 0.25 s apart: the stream the drill kills lasts 100 s, so it is mid-stream
    # when killed (at 0.02 s it ended by itself after 8 s, which a loaded machine could take)
    procs = [_start_fake(port, pace_s=0.25)]
    try:
        yield port, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_backend_killed_mid_stream(make_gateway, fake_process) -> None:
    port, procs = fake_process
    backend = f"http://127.0.0.1:{port}"
    with make_gateway(
        [backend], idle_timeout_s=IDLE_TIMEOUT_S, scrape_interval_s=0.1, admin_key=ADMIN_KEY
    ) as gw:
        got = b""
        with httpx.stream(
            "POST", f"{gw}/v1/chat/completions", json=chat(stream=True), timeout=30
        ) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            while got.count(b"data: ") < 5:  # a few tokens reached the client
                got += next(chunks)
            os.kill(procs[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            for chunk in chunks:
                got += chunk
            closed_after = time.monotonic() - killed
        assert closed_after < IDLE_TIMEOUT_S, closed_after
        events = sse_events(got.decode())
        assert all("choices" in e for e in events[:-1])  # the tokens it had
        assert events[-1]["error"]["code"] == "upstream_broken", events[-1]
        assert backend in events[-1]["error"]["message"]
        assert "[DONE]" not in events

        # marked down: /ready says so, and a request gets a 503 naming the backend
        wait_for(
            lambda: httpx.get(f"{gw}/ready", headers=ADMIN).json()["backends"][backend] != "up"
        )
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert backend in r.json()["error"]["message"]

        # the backend comes back on the same address: served again, to the end
        procs.append(_start_fake(port))
        wait_for(lambda: httpx.get(f"{gw}/ready").status_code == 200)
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True, max_tokens=8))
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and not any("error" in json.dumps(e) for e in events)
