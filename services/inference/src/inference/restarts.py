"""What the supervisor keeps of a vLLM that exited, and when it starts one again: the
exit record (status, uptime, log tail, the engine's root cause), the restart backoff
and the count of failed starts in a row that died of the same cause (`RestartHistory`).

Owns: those records and rules. Does not own: the loop and its state (supervisor.py),
finding the root cause in a log (engine_log.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from inference.engine import VllmServer
from inference.engine_log import RootCause, root_cause

log = logging.getLogger("inference.supervisor")

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


@dataclass
class RestartHistory:
    """The supervisor's restart bookkeeping: starts after the first, failed starts in a
    row (all causes, and the same cause), the last ten exits and the last root cause."""

    restarts: int = 0
    failures: int = 0
    same_failures: int = 0
    exits: list[ExitRecord] = field(default_factory=list)  # newest last, at most 10
    root_cause: RootCause | None = None  # of the last exit that had one

    def record_exit(
        self, server: VllmServer, started_at: float, tail_lines: int
    ) -> RootCause | None:
        """Keep `server`'s exit (`started_at`: unix time of its start; `tail_lines`: log
        lines kept), log it, and return its root cause."""
        record, cause = read_exit(server, started_at, tail_lines)
        self.exits = [*self.exits[-9:], record]
        log.warning(
            "vLLM exited (status %s) after %.0f s; last lines:\n%s",
            record.returncode,
            record.uptime_s,
            "\n".join(record.log_tail[-10:]),
        )
        if cause is not None:
            self.root_cause = cause
            log.error("vLLM's root cause (%s): %s; %s", cause.process or "vLLM", cause, cause.hint)
        return cause

    def reached_ready(self) -> None:
        """vLLM became ready: the counts of failed starts in a row go back to 0."""
        self.failures, self.same_failures = 0, 0

    def give_up(self, cause: RootCause | None, limit: int) -> str:
        """Count the failed start just recorded (`cause`: its root cause); the reason to stop
        restarting once `limit` starts in a row died of the same cause, else "" (and the
        restart is counted)."""
        self.failures += 1
        previous = self.exits[-2].root_cause if len(self.exits) >= 2 else None
        self.same_failures = same_cause_run(previous, cause, self.same_failures)
        if cause is None or self.same_failures < limit:
            self.restarts += 1
            return ""
        log.error(
            "vLLM failed %d times in a row with the same root cause, %s: not restarting it (%s)",
            limit,
            cause,
            cause.hint,
        )
        return f"vLLM failed {limit} times in a row: {cause}"
