"""What the supervisor keeps of a vLLM that exited, and when it starts one again: the
exit record (status, uptime, log tail, the engine's root cause), the restart backoff
and the count of failed starts in a row that died of the same cause.

Owns: those records and rules. Does not own: the loop and its state (supervisor.py),
finding the root cause in a log (engine_log.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference.engine import VllmServer
from inference.engine_log import RootCause, root_cause

ROOT_CAUSE_LINES = 4000  # log lines searched for the engine's first exception


@dataclass
class ExitRecord:
    """How a vLLM exited: code, time, uptime, last log lines and root cause."""

    returncode: int | None
    at: float  # unix time
    uptime_s: float  # seconds since that start
    log_tail: list[str] = field(default_factory=list)
    root_cause: str | None = None  # the engine's first exception, `Name: message`


def backoff_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before restart number `failures` (1, 2, ...): doubling, capped."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1))


def read_exit(
    server: VllmServer, started_at: float, tail_lines: int
) -> tuple[ExitRecord, RootCause | None]:
    """The record of `server`'s exit (`started_at`: unix time of its start; `tail_lines`:
    log lines kept), and its root cause."""
    tail = server.log_tail(tail_lines).splitlines()
    # the engine's traceback sits above the API server's: read further back than /status
    cause = root_cause(server.log_tail(ROOT_CAUSE_LINES))
    record = ExitRecord(
        server.returncode,
        time.time(),
        time.time() - started_at,
        tail,
        str(cause) if cause else None,
    )
    return record, cause


def same_cause_run(previous: str | None, cause: RootCause | None, run: int) -> int:
    """Failed starts in a row that died of `cause`, this one counted: `run` (the count
    so far) + 1 when the previous exit's root cause was the same, else 1."""
    same = cause is not None and run > 0 and previous == str(cause)
    return run + 1 if same else 1
