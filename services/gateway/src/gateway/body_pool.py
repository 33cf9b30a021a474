"""The large-body thread pool: where a request's work that grows with its body runs, on two
threads off the event loop (the worker *processes* of `--workers N` are processes.py's).

A body over `LARGE_BODY_BYTES` is joined, parsed and checked (`request_body.py`),
validated (`endpoints.py`), rendered and counted (`counting.py`), and serialised again
when it must change (`prepared.py`) in `POOL`; the event loop only awaits it, so the
other clients' streams keep moving. A few thousand bytes take well under a millisecond
on the loop, less than the hop to a thread.

The threads still share the GIL with the loop. The tokenizer's encode releases it; the
rest is Python, or C that lets it go between objects (`lorastack.untrusted_json`), and
`share_the_gil` shortens how long the loop waits for it (the interpreter's default is
5 ms a turn, and a stream's first event takes the loop several turns). Two more costs
grow with a body's objects (~10^5 for 4 MiB of `tools`) wherever they happen: a full
collection of the cyclic GC walks them all (15-35 ms, holding the GIL), and freeing them
takes ~8 ms. `LargeBody` keeps them from the parse until the request no longer needs
them, with the collector paused meanwhile (they are freed before it walks them), and
lets them go on a worker thread. What is left is measured in bench/gateway/README.md.

Owns: the pool, the size that sends work there, the switch interval, the collector's
pauses. Does not own: the work itself (request_body.py, endpoints.py, counting.py,
prepared.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

# bytes of request body: larger requests are handled in POOL, smaller ones on the loop
LARGE_BODY_BYTES = 8192
SWITCH_INTERVAL_S = 0.0005  # seconds a thread may hold the GIL while another waits for it
# seconds: a large body that arrives later than this into a pause does not join it, so
# large bodies one after the other cannot keep the collector off for long
MAX_GC_PAUSE_S = 10.0

P = ParamSpec("P")
T = TypeVar("T")


def _lower_priority() -> None:
    """Worker threads run 10 nice levels below the process (Linux sets it per thread): a
    large body waits for the CPU, not the event loop relaying everyone else's streams."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + 10, 19))


# two threads: at most two large bodies are worked on at once, others wait their turn
POOL = ThreadPoolExecutor(2, thread_name_prefix="large", initializer=_lower_priority)


async def run_for_body(
    body_bytes: int, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
) -> T:
    """`fn(*args, **kwargs)`: in `POOL` when the request's body has more than
    `LARGE_BODY_BYTES` bytes, else here on the loop."""
    if body_bytes <= LARGE_BODY_BYTES:
        return fn(*args, **kwargs)
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(POOL, call)


def share_the_gil() -> None:
    """Let a thread that waits for the GIL (the loop, while a worker parses) have it
    after `SWITCH_INTERVAL_S`, not the interpreter's 5 ms: for the whole process."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))


class CollectorPause:
    """The cyclic collector off while any large body is kept (holders counted across
    threads); left alone when something else turned it off. A holder that comes more
    than `max_pause_s` into a pause does not join it (`enter` is False): the pause ends
    with the holders it has."""

    def __init__(
        self, max_pause_s: float = MAX_GC_PAUSE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._since = 0.0  # clock seconds: when the current pause began
        self._max_pause_s = max_pause_s
        self._clock = clock

    def enter(self) -> bool:
        """Pause the collector, or join the pause; True when the caller must `leave`."""
        with self._lock:
            now = self._clock()
            if self._holders == 0:
                if not gc.isenabled():
                    return False
                gc.disable()
                self._since = now
            elif now - self._since > self._max_pause_s:
                return False
            self._holders += 1
            return True

    def leave(self) -> None:
        """Leave the pause; the last holder turns the collector back on."""
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                gc.enable()


_PAUSE = CollectorPause()


class LargeBody:
    """The parsed objects of one request's large body, from before its parse until the
    request no longer needs them (`release`, once, when the request's preparation is over
    and no frame refers to them any more): the collector stays paused meanwhile, and the
    last references are dropped on a worker thread, which frees the objects there. For a
    small body every call is a no-op."""

    def __init__(self) -> None:
        self._objects: list[Any] = []
        self._paused = False
        self._large = False

    def begin(self, body_bytes: int) -> None:
        """Before parsing a body of `body_bytes` bytes."""
        if body_bytes > LARGE_BODY_BYTES and not self._large:
            self._large = True
            self._paused = _PAUSE.enter()

    def keep(self, *objects: Any) -> None:
        """Hold `objects` until `release` (a small body holds nothing)."""
        if self._large:
            self._objects.extend(objects)

    def release(self) -> None:
        """Drop the held objects on a worker thread (once; inline at interpreter shutdown)."""
        if self._large:
            self._large = False
            try:
                POOL.submit(self._let_go)
            except RuntimeError:  # the interpreter is shutting down: no new work there
                self._let_go()

    def _let_go(self) -> None:
        self._objects.clear()
        if self._paused:
            self._paused = False
            _PAUSE.leave()
