"""The hot path's HTTP/1.1 client: parsing (pure), pooling, timeouts, disconnects.

Against the fake upstream (uvicorn in a thread) and, where a test needs bytes the fake
never sends (a response split at every byte, a keep-alive socket closed by the server),
against a raw asyncio server in the test's own loop. Every scenario runs on uvloop, as
the gateway does.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from test_gateway_sse import _ClockLoop

from gateway import h1client
from gateway.claims import InflightCounter
from gateway.errors import UpstreamBroken, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from gateway.h1client import Connection, H1Client, Pool
from gateway.h1wire import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    BadRequestHead,
    BadResponse,
    ConnectFailed,
    Disconnected,
    ResponseParser,
    request_bytes,
)
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.upstream import Upstream

CHAT = "/v1/chat/completions"
# connects to loopback servers: a deadline a stalled loop cannot miss, not the 1-2 s it was
CONNECT_S = 30.0
JSON = {"content-type": "application/json"}


def run(coro: Awaitable[Any]) -> Any:
    return uvloop.run(coro)  # type: ignore[arg-type]


def chat_body(stream: bool = True, **extra: Any) -> bytes:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return json.dumps({**body, **extra}).encode()


async def exchange(pool: Pool, body: bytes) -> tuple[Connection, int, bytes]:
    conn = await pool.acquire()
    conn.send(request_bytes("POST", pool.host_header, CHAT, body, JSON))
    head = await conn.head()
    raw = b""
    while chunk := await conn.read():
        raw += chunk
    return conn, head.status, raw


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait (on the loop) until `cond()` holds: what a test awaits, not a guessed sleep."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


# --- h1wire: pure parsing ---------------------------------------------------------------
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"d\r\ndata: first\n\n\r\n"
    b"e\r\ndata: second\n\n\r\n"
    b"0\r\n\r\n"
)


def test_chunked_body_split_at_every_byte_decodes_the_same() -> None:
    for cut in range(1, len(CHUNKED)):
        p = ResponseParser()
        p.feed(CHUNKED[:cut])
        got = p.take()
        p.feed(CHUNKED[cut:])
        got += p.take()
        assert got == b"data: first\n\ndata: second\n\n", cut
        assert p.complete and p.keep_alive and p.status == 200
        assert p.headers["content-type"] == "text/event-stream"
    p = ResponseParser()  # one byte per feed
    got = b""
    for i in range(len(CHUNKED)):
        p.feed(CHUNKED[i : i + 1])
        got += p.take()
    assert got == b"data: first\n\ndata: second\n\n" and p.complete


def test_content_length_eof_and_connection_close() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\nConnection: close\r\n\r\nno")
    assert p.head_done and p.status == 404 and not p.complete
    p.feed(b"pe!")
    assert p.take() == b"nope!" and p.complete and not p.keep_alive
    # no length, not chunked: the body ends with the connection
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\n\r\npartial")
    assert not p.complete and p.take() == b"partial"
    assert p.eof() and p.complete and not p.keep_alive
    # a content-length body cut short is not complete at EOF
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    assert not p.eof()


def test_interim_1xx_then_the_response_and_bad_bytes() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert not p.head_done
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert p.status == 200 and p.take() == b"ok" and p.complete
    with pytest.raises(BadResponse):
        p.feed(b"HTTP/1.1 200 OK\r\n")  # nothing may follow a complete response
    with pytest.raises(BadResponse):
        ResponseParser().feed(b"SMTP ready\r\n\r\n")


def test_request_bytes() -> None:
    raw = request_bytes("POST", "h:8000", "/v1/completions", b"{}", JSON)
    assert raw == (
        b"POST /v1/completions HTTP/1.1\r\nHost: h:8000\r\nContent-Length: 2\r\n"
        b"content-type: application/json\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    ("method", "path", "headers", "why"),
    [
        ("POST", "/v1/x", {"x-a": "1\r\nX-Injected: yes"}, "CR, LF or NUL"),
        ("POST", "/v1/x", {"x-a": "1\nX-Injected: yes"}, "CR, LF or NUL"),
        ("POST", "/v1/x", {"x-a\r\nx-b": "1"}, "CR, LF or NUL"),
        ("POST", "/v1/x", {"x-a": "1\x00"}, "CR, LF or NUL"),
        ("POST", "/v1/x HTTP/1.1\r\nX-Injected: yes\r\n\r\nGET /", {}, "CR, LF or NUL"),
        ("POST", "/v1/x /y", {}, "not a valid method, path or field name"),
        ("POST", "/v1/x", {"x a": "1"}, "not a valid method, path or field name"),
        ("POST", "/v1/x", {"x:a": "1"}, "not a valid method, path or field name"),
        ("POST", "/v1/x", {f"x-{i}": "1" for i in range(MAX_HEADERS + 1)}, "header fields"),
        ("POST", "/v1/x", {"x-a": "v" * MAX_HEADER_BYTES}, "request head of"),
        ("POST", "/v1/x", {"x-a": "\u2713"}, "outside latin-1"),
    ],
)
def test_request_bytes_refuses_what_could_split_the_request(
    method: str, path: str, headers: dict[str, str], why: str
) -> None:
    with pytest.raises(BadRequestHead, match=why):
        request_bytes(method, "h:8000", path, b"{}", headers)


def test_request_bytes_takes_the_largest_head_allowed() -> None:
    many = {f"x-{i}": "1" for i in range(MAX_HEADERS)}
    assert request_bytes("POST", "h", "/v1/x", b"", many).count(b"\r\n") == MAX_HEADERS + 4
    pad = MAX_HEADER_BYTES - len(request_bytes("POST", "h", "/v1/x", b"", {"x-a": ""}))
    assert len(request_bytes("POST", "h", "/v1/x", b"", {"x-a": "v" * pad})) == MAX_HEADER_BYTES


# --- h1client against the fake upstream --------------------------------------------------
def test_keep_alive_reuses_one_connection(fake) -> None:
    url, state = fake

    async def scenario() -> None:
        client = H1Client(connect_timeout_s=CONNECT_S)
        pool = client.pool(url)
        ports = set()
        for stream in (True, False, True):
            conn, status, raw = await exchange(pool, chat_body(stream))
            assert status == 200
            if stream:
                assert raw.endswith(b"data: [DONE]\n\n")
            else:
                assert json.loads(raw)["choices"][0]["message"]["content"] == "Hello, world! Bye."
            ports.add(conn.transport.get_extra_info("sockname")[1])  # type: ignore[union-attr]
            pool.release(conn)
            assert pool.idle == [conn]
        assert len(ports) == 1  # three exchanges, one TCP connection
        client.close()
        assert conn.closed

    run(scenario())
    assert len(state.calls()) == 3


def test_two_at_once_open_two_connections_and_both_return(fake) -> None:
    url, _ = fake

    async def scenario() -> None:
        pool = H1Client(connect_timeout_s=CONNECT_S).pool(url)
        (a, sa, _), (b, sb, _) = await asyncio.gather(
            exchange(pool, chat_body()), exchange(pool, chat_body())
        )
        assert a is not b and sa == sb == 200
        pool.release(a)
        pool.release(b)
        assert len(pool.idle) == 2
        assert await pool.acquire() is b  # the newest first
        pool.close()

    run(scenario())


def test_backend_dying_mid_stream_raises_disconnected(fake) -> None:
    url, state = fake
    state.die_after_tokens = 2
    state.pace_s = 0.01

    async def scenario() -> bytes:
        pool = H1Client(connect_timeout_s=CONNECT_S).pool(url)
        conn = await pool.acquire()
        conn.send(request_bytes("POST", pool.host_header, CHAT, chat_body(), JSON))
        assert (await conn.head()).status == 200
        got = b""
        with pytest.raises(Disconnected, match="mid-response"):
            while True:
                chunk = await conn.read()
                assert chunk, "a broken stream must not look complete"
                got += chunk
        assert conn.closed and not conn.reusable()
        pool.release(conn)  # not reusable: closed, not pooled
        assert pool.idle == []
        return got

    got = run(scenario())
    assert got.count(b"data: ") == 3  # the role event and two tokens, then the break


def test_cancelled_read_closes_the_connection_and_never_pools_it(fake) -> None:
    url, state = fake
    state.pace_s = 30.0  # the next token never comes in the test: only the cancel ends the read

    async def scenario() -> None:
        settings = GatewaySettings(backends=[url], retry_backoff_s=0.01)
        up = Upstream(settings, GatewayMetrics(), InflightCounter())
        call = await up.open(lambda tried: url, CHAT, chat_body(), JSON)
        assert await call.read()  # the first events
        reader = asyncio.ensure_future(call.read())  # waits for the next (paced) token
        await until(lambda: call.conn._waiter is not None)  # the read is waiting
        reader.cancel()  # the client hung up
        with pytest.raises(asyncio.CancelledError):
            await reader
        await call.aclose()
        assert call.conn.closed and up.inflight.counts[url] == 0
        assert url not in up._client.pools  # never back to a pool (none left: dropped)
        # the next request opens a new connection and works
        again = await up.open(lambda tried: url, CHAT, chat_body(), JSON)
        assert again.conn is not call.conn
        await again.aclose()
        await up.aclose()

    run(scenario())
    # the backend saw both unfinished streams go (vLLM aborts them)
    wait_for(lambda: state.cancelled == 2 and state.completed == 0)


def test_complete_stream_goes_back_to_the_pool_through_upstream(fake) -> None:
    url, _ = fake

    async def scenario() -> None:
        up = Upstream(GatewaySettings(backends=[url]), GatewayMetrics(), InflightCounter())
        call = await up.open(lambda tried: url, CHAT, chat_body(), JSON)
        assert call.status == 200 and call.content_type.startswith("text/event-stream")
        raw = b"".join([c async for c in call.chunks()])
        assert raw.endswith(b"data: [DONE]\n\n")
        await call.aclose()
        assert up._client.pools[url].idle == [call.conn] and up.inflight.counts[url] == 0
        await up.aclose()

    run(scenario())


def test_first_byte_and_idle_timeouts(fake) -> None:
    """The backends never answer in time: whatever the machine's load, only the gateway's
    limits can end the waits (a backend answering 0.3 s after the limit raced a late timer)."""
    url, state = fake
    asked: list[bytes] = []
    finish = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await read_request(reader))
        await finish.wait()  # no head until the test is over
        writer.close()

    async def scenario() -> None:
        # no head within the first-byte limit: 504-type error, not retried
        server, silent_url = await raw_server(silent)
        settings = GatewaySettings(
            backends=[silent_url], first_byte_timeout_s=0.1, retry_backoff_s=0.01
        )
        up = Upstream(settings, GatewayMetrics(), InflightCounter())
        with pytest.raises(UpstreamTimeout, match=r"did not answer within 0\.1 s"):
            await up.open(lambda tried: silent_url, CHAT, chat_body(), JSON)
        assert len(asked) == 1 and up.inflight.counts[silent_url] == 0
        assert silent_url not in up._client.pools  # the timed-out connection was closed
        await up.aclose()
        finish.set()
        server.close()
        # the head came, then a gap longer than the idle limit (the next token: in 30 s)
        settings = GatewaySettings(
            backends=[url], first_byte_timeout_s=0.1, idle_timeout_s=0.1, retry_backoff_s=0.01
        )
        up = Upstream(settings, GatewayMetrics(), InflightCounter())
        state.pace_s = 30.0
        call = await up.open(lambda tried: url, CHAT, chat_body(), JSON)
        assert await call.read()
        with pytest.raises(UpstreamTimeout, match=r"sent nothing for 0\.1 s"):
            await call.read()
        await call.aclose()
        assert call.conn.closed and url not in up._client.pools
        await up.aclose()

    run(scenario())


def test_connect_refused_and_connect_timeout() -> None:
    port = _closed_port()

    async def refused() -> None:
        pool = Pool(f"http://127.0.0.1:{port}", connect_timeout_s=1)
        with pytest.raises(ConnectFailed, match="ConnectionRefused"):
            await pool.acquire()

    run(refused())
    # a listener that never accepts and whose queue is full: the SYN goes unanswered
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    fill = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(srv.getsockname())
            fill.append(s)
        time.sleep(0.05)

        async def timeout() -> None:
            pool = Pool(f"http://127.0.0.1:{srv.getsockname()[1]}", connect_timeout_s=0.2)
            t0 = time.monotonic()
            with pytest.raises(ConnectFailed, match=r"connect timed out after 0\.2 s"):
                await pool.acquire()
            # the limit ended it (the message says so), not the kernel: that takes minutes
            assert time.monotonic() - t0 < 30.0

        run(timeout())
    finally:
        for s in fill:
            s.close()
        srv.close()


def test_connect_errors_are_retried_then_unavailable() -> None:
    backend = f"http://127.0.0.1:{_closed_port()}"

    async def scenario() -> None:
        settings = GatewaySettings(backends=[backend], retry_attempts=3, retry_backoff_s=0.001)
        metrics = GatewayMetrics()
        up = Upstream(settings, metrics, InflightCounter())
        with pytest.raises(UpstreamUnavailable, match="after 3 attempts"):
            await up.open(lambda tried: backend, CHAT, chat_body(), JSON)
        assert metrics.upstream_errors.labels(backend, "connect")._value.get() == 3
        assert metrics.retries._value.get() == 2 and up.inflight.counts[backend] == 0
        await up.aclose()

    run(scenario())


def test_error_statuses_retry_503_and_pass_4xx(fake) -> None:
    url, state = fake

    async def scenario() -> None:
        settings = GatewaySettings(backends=[url], retry_attempts=3, retry_backoff_s=0.001)
        up = Upstream(settings, GatewayMetrics(), InflightCounter())
        state.fail_status, state.fail_count = 503, 1
        call = await up.open(lambda tried: url, CHAT, chat_body(stream=False), JSON)
        assert call.status == 200 and json.loads(b"".join([c async for c in call.chunks()]))
        await call.aclose()
        with pytest.raises(UpstreamRejected) as e:
            await up.open(lambda tried: url, CHAT, chat_body(model="nope"), JSON)
        assert e.value.status == 404 and b"does not exist" in e.value.raw
        assert up.inflight.counts[url] == 0
        assert len(up._client.pools[url].idle) == 1  # error bodies read to the end: reused
        await up.aclose()

    run(scenario())
    assert len(state.calls()) == 3


# --- raw servers: bytes the fake never sends ----------------------------------------------
async def raw_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def test_chunked_stream_split_across_socket_reads() -> None:
    checked = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for i in range(0, len(CHUNKED), 7):  # 7-byte writes, each flushed on its own
            writer.write(CHUNKED[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0.002)
        await checked.wait()  # open until the client has judged the connection reusable
        writer.close()

    async def scenario() -> None:
        server, url = await raw_server(handler)
        pool = H1Client(connect_timeout_s=CONNECT_S).pool(url)
        conn, status, raw = await exchange(pool, b"{}")
        assert status == 200 and raw == b"data: first\n\ndata: second\n\n"
        assert conn.reusable()
        checked.set()
        pool.release(conn)
        server.close()

    run(scenario())


def test_keep_alive_connection_closed_by_the_backend_is_not_reused() -> None:
    served = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive announced, then closed (what an idle timeout does)

    async def scenario() -> None:
        server, url = await raw_server(handler)
        pool = H1Client(connect_timeout_s=CONNECT_S).pool(url)
        first, status, raw = await exchange(pool, b"{}")
        assert (status, raw) == (200, b"ok")
        pool.release(first)
        await until(lambda: first.closed)  # the backend's FIN arrives while it is idle
        second, status, _ = await exchange(pool, b"{}")
        assert second is not first and status == 200
        server.close()

    run(scenario())
    assert len(served) == 2


def test_a_reused_connection_that_dies_before_the_head_is_retried() -> None:
    count = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            count += 1
            if count == 2:  # the second request, on the kept connection: hang up unanswered
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def scenario() -> None:
        server, url = await raw_server(handler)
        settings = GatewaySettings(backends=[url], retry_backoff_s=0.001)
        metrics = GatewayMetrics()
        up = Upstream(settings, metrics, InflightCounter())
        for _ in range(2):
            call = await up.open(lambda tried: url, CHAT, b"{}", JSON)
            assert b"".join([c async for c in call.chunks()]) == b"ok"
            await call.aclose()
        assert metrics.retries._value.get() == 1  # the dead keep-alive connection, retried
        await up.aclose()
        server.close()

    run(scenario())
    assert count == 3


def test_backend_bytes_that_are_not_http_break_the_response() -> None:
    hello_read, done = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await hello_read.wait()  # the good chunk reached the client on its own
        writer.write(b"ZZZ\r\n")  # after the head: no retry, the response broke
        await writer.drain()
        await done.wait()
        writer.close()

    async def scenario() -> None:
        server, url = await raw_server(handler)
        up = Upstream(GatewaySettings(backends=[url]), GatewayMetrics(), InflightCounter())
        call = await up.open(lambda tried: url, CHAT, b"{}", JSON)
        assert await call.read() == b"hello"
        hello_read.set()
        with pytest.raises(UpstreamBroken, match=r"invalid HTTP/1\.1"):
            await call.read()
        await call.aclose()
        assert call.conn.closed and url not in up._client.pools
        await up.aclose()
        done.set()
        server.close()

    run(scenario())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_idle_connections_expire_and_the_sweeper_closes_them(fake) -> None:
    url, _ = fake
    assert H1Client(connect_timeout_s=1, keepalive_s=0.3).pool(url).keepalive_s == 0.3
    assert Pool(url, connect_timeout_s=1).keepalive_s == h1client.KEEPALIVE_S
    with pytest.raises(ValueError, match="keepalive_s"):
        Pool(url, connect_timeout_s=1, keepalive_s=0)

    async def scenario() -> None:
        # the keep-alive on a clock the test moves (real sleeps against a 0.3 s limit let
        # b expire too on a loaded machine); whole seconds: no float rounding at the edges
        clock = _ClockLoop()
        pool = Pool(url, connect_timeout_s=CONNECT_S, keepalive_s=4.0, clock=clock)  # type: ignore[arg-type]
        (a, _, _), (b, _, _) = await asyncio.gather(
            exchange(pool, chat_body()), exchange(pool, chat_body())
        )
        pool.release(a)
        clock.advance(2.0)
        pool.release(b)
        clock.advance(3.0)  # a is past its 4 s (the sweeper ran at 4), b is not
        assert a.closed and not b.closed and pool.idle == [b]
        clock.advance(0.5)  # 5.5: b has 0.5 s left
        assert not b.closed and pool.idle == [b]
        clock.advance(0.5)  # 6: the sweeper, re-armed for b's 4 s, runs
        assert b.closed and pool.idle == []  # nothing left for a request to find
        pool.close()

    run(scenario())


def test_a_reader_that_falls_behind_pauses_the_connection() -> None:
    big = b"x" * (h1client.HIGH_WATER * 4)
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        await done.wait()  # open until the client has read it all
        writer.close()

    async def scenario() -> None:
        server, url = await raw_server(handler)
        pool = Pool(url, connect_timeout_s=CONNECT_S)
        conn = await pool.acquire()
        conn.send(request_bytes("POST", pool.host_header, CHAT, b"{}", JSON))
        p = await conn.head()
        await until(lambda: conn._paused)  # the backend sends; nobody reads
        assert p.body_bytes <= h1client.HIGH_WATER + 2**18
        got = b""
        while chunk := await conn.read():
            got += chunk
        assert got == big and conn.reusable()
        done.set()
        server.close()

    run(scenario())


def test_a_backend_whose_connections_are_all_gone_leaves_no_pool(fake, second_fake) -> None:
    """Issue 58: a pool was kept for every backend ever used (replicas that come and go
    with new addresses under backends_dns left one each). A pool is dropped once it holds
    no connection, in use or idle; one in use keeps it."""
    gone, _ = fake
    stays, _ = second_fake

    async def scenario() -> None:
        client = H1Client(connect_timeout_s=CONNECT_S)
        (first, _, _), (second, _, _) = await asyncio.gather(
            exchange(client.pool(gone), chat_body()), exchange(client.pool(gone), chat_body())
        )
        kept, _, _ = await exchange(client.pool(stays), chat_body())
        client.pool(stays).release(kept)
        pool = client.pool(gone)
        assert pool.busy == 2
        pool.discard(first)  # its backend went away mid-exchange
        assert first.closed and set(client.pools) == {gone, stays}  # `second` is in use
        pool.discard(second)
        assert set(client.pools) == {stays}  # nothing left of `gone`
        assert not kept.closed and client.pool(stays).idle == [kept]
        assert client.pool(gone) is not pool  # a request to it again makes a new one
        client.close()

    run(scenario())


def test_a_pool_whose_last_idle_connection_expires_is_dropped(fake) -> None:
    url, _ = fake

    async def scenario() -> None:
        clock = _ClockLoop()  # the keep-alive on a clock the test moves
        emptied: list[Pool] = []
        pool = Pool(
            url,
            connect_timeout_s=CONNECT_S,
            keepalive_s=4.0,
            clock=clock,
            on_empty=emptied.append,  # type: ignore[arg-type]
        )
        (a, _, _), (b, _, _) = await asyncio.gather(
            exchange(pool, chat_body()), exchange(pool, chat_body())
        )
        pool.release(a)
        clock.advance(5.0)  # a expired; b, in use, keeps the pool
        assert a.closed and pool.idle == [] and emptied == []
        pool.release(b)
        clock.advance(3.0)
        assert emptied == []  # b is kept for its 4 s
        clock.advance(1.0)
        assert b.closed and emptied == [pool]
        pool.close()

    run(scenario())
