"""Loopback servers for tests and benchmarks: a free port, an ASGI app in a thread, a
poll until something is true."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll `check` every 50 ms until it is true; AssertionError naming `what` after
    `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port nothing listens on at the moment (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int = 0, host: str = "127.0.0.1") -> Iterator[str]:
    """Run an ASGI app with uvicorn on host:port (0: any free one) in a thread; yields its
    base URL and stops the server on exit (open requests get uvicorn's 2-s graceful
    shutdown, as a replica's server has at SIGTERM). `host` may be any 127.0.0.0/8 address
    (Linux routes them all to loopback): replicas on one port, told apart by address."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="critical",
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.01)
    bound = int(server.servers[0].sockets[0].getsockname()[1]) if port == 0 else port
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
