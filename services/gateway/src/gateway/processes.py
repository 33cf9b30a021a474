"""`lorastack gateway --workers N`: N worker processes serving one port, and the parent
that starts them and replaces any that dies.

The parent binds the listening socket once and hands it to each worker (spawned, as
uvicorn's own `--workers` does): every worker accepts on it, so the connections waiting
in its queue outlive a worker's death. Each worker runs `create_app(settings, WorkerSlot)`
under uvicorn. What the workers must agree on exactly lives in a run folder the parent
makes: the KV claims and the admission line (`shared_claims.py`) and the metric files
(`metrics.py`); per-key limits and budgets are Redis's (`settings.workers` requires
`redis_url` for them). The backend scrapes, tokenizers, keys file and affinity tables are
each worker's own: copies that are only read, or routing hints.

A worker that dies (killed, crashed) loses the streams it was relaying: their clients
see the connection close before the last event, and their backend connections close, so
vLLM aborts them. The parent then zeroes the worker's slot of the shared counts, marks
its metric files dead and starts a new worker in its place, which accepts connections
once its own /ready answers 200 (`once_ready`: until then the others take them). A
worker that holds the shared counts' lock for `LOCK_STALL_S` (stopped or frozen there,
it stops every other worker's loop) is killed by the parent's lock watch, and replaced
the same way. SIGTERM or SIGINT to the parent closes its copy of the listening socket,
then stops the workers (each closes its own, so new connections are refused at once, and
finishes its streams for up to `shutdown_grace_s`, uvicorn's graceful shutdown), and
removes the run folder; the run folder of a parent killed by SIGKILL is removed by the
next gateway's start (`sweep_run_folders`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.settings import GatewaySettings
from gateway.shared_claims import LockWatch, SharedInflight, WorkerSlot

log = logging.getLogger(__name__)

# uvicorn's options, one worker or N: loop and http named, not "auto", so a missing package
# fails at start instead of silently falling back to asyncio + h11 (several times slower)
UVICORN_OPTIONS: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "log_level": "warning",
    "access_log": False,
    "proxy_headers": False,  # GatewayApp applies them to the routes that read them
}
QUICK_EXIT_S = 5.0  # a worker that exits sooner than this after its start failed to start
MAX_QUICK_EXITS = 3  # in a row, in one slot: the parent gives up (the error is in the log)
RUN_PREFIX = "lorastack-gateway-"  # + the parent's pid + "-": the run folder's name
STOP_MARGIN_S = 5.0  # past shutdown_grace_s, a stopping worker is killed
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
# a worker holds the claims lock for microseconds; one that holds it this long (seconds)
# is stopped or frozen, and every other worker's loop waits on it: the parent kills it
LOCK_STALL_S = 1.0
LOCK_CHECK_S = 0.25  # seconds between the parent's looks at the lock
# seconds a replacement worker waits at most to be ready before it accepts anyway
READY_WAIT_S = 60.0


def uvicorn_options(settings: GatewaySettings) -> dict[str, Any]:
    """UVICORN_OPTIONS and the graceful shutdown's length (`shutdown_grace_s`)."""
    return {**UVICORN_OPTIONS, "timeout_graceful_shutdown": settings.shutdown_grace_s}


_spawn = multiprocessing.get_context("spawn")
multiprocessing.allow_connection_pickling()  # a socket goes to a spawned worker


class _Stop(Exception):
    """SIGTERM or SIGINT reached the parent."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_worker(
    settings: GatewaySettings,
    slot: WorkerSlot,
    sock: socket.socket,
    parent: int,
    replacement: bool = False,
) -> None:
    """A worker's process: the app on the parent's socket, until SIGTERM or SIGINT, or
    until the parent dies (even by SIGKILL: no worker keeps serving without it). A
    `replacement` (of a worker that died) accepts once ready (`once_ready`)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the prctl
        return
    import uvicorn

    from gateway.main import create_app

    app: ASGIApp = create_app(settings, slot)
    if replacement:
        app = once_ready(app, READY_WAIT_S, settings.scrape_interval_s)
    config = uvicorn.Config(app, **uvicorn_options(settings))
    uvicorn.Server(config).run(sockets=[sock])


def once_ready(app: ASGIApp, within_s: float, every_s: float) -> ASGIApp:
    """`app`, whose start waits until its own GET /ready answers 200 (its backends scraped,
    its tokenizers loaded), asked every `every_s` seconds, for `within_s` seconds at most.

    uvicorn accepts on the socket only once the app's lifespan has started: a worker that
    replaces a dead one takes no connection it could not serve yet while the others can
    (the parent's socket queues for them). The workers of a start serve at once: /health
    answers while the backends come up, and /ready says when they serve."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def started(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await _until_ready(app, within_s, every_s)
            await send(message)

        await app(scope, receive, started)

    return wrapped


async def _until_ready(app: ASGIApp, within_s: float, every_s: float) -> None:
    import httpx

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        while (await client.get("/ready")).status_code != 200:
            if loop.time() >= deadline:
                log.warning("gateway worker not ready after %g s: serving anyway", within_s)
                return
            await asyncio.sleep(every_s)


def watch_lock(claims: Path, workers: Callable[[], Collection[int]], stop: threading.Event) -> None:
    """The parent's thread, until `stop` is set: SIGKILL a worker (one of `workers()`'s
    pids) that has held the claims lock for `LOCK_STALL_S` (`LockWatch`). The kernel drops
    a dead process's lock, so the other workers go on; the parent replaces the killed one
    as any that dies (its streams are lost, as they were while it was stopped)."""
    watch = LockWatch(claims)
    try:
        while not stop.wait(LOCK_CHECK_S):
            pid = watch.stalled(time.monotonic(), LOCK_STALL_S)
            if pid is not None and pid in workers():
                log.error(
                    "gateway worker (pid %d) has held the claims lock for %g s or more (stopped"
                    " or frozen): every worker waits on it; killing it",
                    pid,
                    LOCK_STALL_S,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        watch.close()


def listen(host: str, port: int) -> socket.socket:
    """The listening socket the workers share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)


def serve(settings: GatewaySettings) -> int:
    """Run `settings.workers` workers on `settings.port` until SIGTERM or SIGINT; 0 then,
    1 when a worker kept failing at its start."""
    sweep_run_folders(Path(tempfile.gettempdir()))
    run_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-"))
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    claims = run_dir / "claims"
    SharedInflight.create(claims, settings.workers)
    shared = SharedInflight(claims, 0)
    # prometheus_client reads it at its import, in each spawned worker
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    sock = listen(settings.host, settings.port)
    procs: dict[int, tuple[BaseProcess, float]] = {}

    def start(slot: int) -> None:
        place = WorkerSlot(slot, claims, metrics_dir)
        replacement = slot in procs
        proc = _spawn.Process(
            target=run_worker,
            args=(settings, place, sock, os.getpid(), replacement),
            daemon=False,
        )
        proc.start()
        procs[slot] = (proc, time.monotonic())

    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    quick = dict.fromkeys(range(settings.workers), 0)
    code = 0
    watching = threading.Event()
    watcher = threading.Thread(
        target=watch_lock,
        args=(claims, lambda: {proc.pid for proc, _ in list(procs.values())}, watching),
        name="claims-lock-watch",
        daemon=True,
    )
    watcher.start()
    try:
        for slot in range(settings.workers):
            start(slot)
        log.warning("gateway: %d workers on %s:%d", settings.workers, settings.host, settings.port)
        while True:
            ended = wait([proc.sentinel for proc, _ in procs.values()])
            for slot, (proc, since) in list(procs.items()):
                if proc.sentinel not in ended:
                    continue
                proc.join()
                shared.clear_slot(slot)  # its streams died with it: so did their claims
                _mark_dead(proc.pid, metrics_dir)
                quick[slot] = quick[slot] + 1 if time.monotonic() - since < QUICK_EXIT_S else 0
                if quick[slot] >= MAX_QUICK_EXITS:
                    log.error(
                        "gateway worker %d exited %d times within %g s of its start (exit"
                        " code %s): stopping; its error is above",
                        slot,
                        quick[slot],
                        QUICK_EXIT_S,
                        proc.exitcode,
                    )
                    code = 1
                    raise _Stop("a worker keeps failing")
                log.warning(
                    "gateway worker %d (pid %s) exited with code %s: its streams are lost;"
                    " starting another",
                    slot,
                    proc.pid,
                    proc.exitcode,
                )
                start(slot)
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # first: the kernel stops taking connections once no process holds the socket
        # (each worker closes its copy as its graceful shutdown begins); kept open, it
        # went on queueing connections that no worker would ever accept
        sock.close()
        _stop_all([proc for proc, _ in procs.values()], settings.shutdown_grace_s + STOP_MARGIN_S)
        watching.set()
        watcher.join()
        shared.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def sweep_run_folders(tmp: Path) -> None:
    """Remove the run folders (`RUN_PREFIX` + the parent's pid) of gateways whose parent
    died without removing its own: killed by SIGKILL, its `finally` never ran (its workers
    followed it, by PR_SET_PDEATHSIG)."""
    for folder in tmp.glob(f"{RUN_PREFIX}*-*"):
        pid = folder.name.removeprefix(RUN_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stop_all(procs: list[BaseProcess], wait_s: float) -> None:
    """SIGTERM to every worker (uvicorn's graceful shutdown), SIGKILL to one still alive
    after `wait_s` seconds."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _mark_dead(pid: int | None, metrics_dir: Path) -> None:
    """Drop a dead worker's live gauges (its counters and histograms stay in the sums)."""
    from prometheus_client import multiprocess

    if pid is not None:
        multiprocess.mark_process_dead(pid, str(metrics_dir))
