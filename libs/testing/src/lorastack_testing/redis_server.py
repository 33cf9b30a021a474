"""A real `redis-server` (Debian's package) on a free loopback port, in a temporary
folder, with nothing persisted: for tests of what the gateway keeps in Redis."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

from lorastack_testing.net import free_port

MISSING = (
    "redis-server is not installed: scripts/setup.sh installs Debian's package"
    " (apt-get install redis-server)"
)


def redis_binary() -> str | None:
    """The path of `redis-server`, or None when it is not installed."""
    return shutil.which("redis-server")


def require_redis_server() -> None:
    """In a test: skip it, naming the package, where redis-server is missing; fail it
    instead where CI is set (CI installs the package: scripts/setup.sh)."""
    import pytest

    if redis_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def serve_redis(port: int = 0, options: Sequence[str] = ()) -> Iterator[str]:
    """`with serve_redis() as url:` redis://127.0.0.1:PORT/0 until the block ends (the
    server is killed then), with `options` (redis-server's command-line options) after
    ours. RuntimeError naming the package when the binary is missing, or with the server's
    log when it does not start."""
    binary = redis_binary()
    if binary is None:
        raise RuntimeError(MISSING)
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="lorastack-redis-") as tmp:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        args += options
        with open(f"{tmp}/redis.log", "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 15
            while not _pong(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(f"{tmp}/redis.log") as f:
                        raise RuntimeError(f"redis-server did not start: {f.read()[-2000:]}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()
