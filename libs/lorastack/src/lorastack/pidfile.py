"""Pid files that name a process we started, and the check before we signal one.

A pid alone is not an identity: once the process exits, the kernel hands the number to
the next process, so a pid file left behind (a crash, a reboot, a copied HOME) can name
an unrelated program, and signalling its group would kill that program. The file here is
JSON: the pid, the process's create time and its command line (both read with psutil
right after the start), plus whatever the writer adds (`extra`). A process is ours when
the pid runs, was created at the recorded time and runs the recorded command line.

    write_pidfile(path, proc.pid, owner=...)   after Popen (exec has happened by then)
    found = find_ours(path)                     .process: ours, or None with .problem
    stop_group(found)                           SIGTERM the group, wait, SIGKILL survivors

Owns the file format and the identity check; not what the process is (the callers:
`lorastack up/down/status`, the inference engine's leftover vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

# seconds. psutil's create_time is the boot time plus the process's start in clock
# ticks since boot; the boot time it adds moves with clock adjustments (NTP), so the
# same process can read back a little off. A reused pid also needs the same command line.
CREATE_TIME_SLACK_S = 1.0


@dataclass(frozen=True)
class PidRecord:
    """A process we started: pid, start time and command line, to recognise it later."""

    pid: int
    create_time: float  # seconds since the epoch, psutil.Process.create_time()
    cmdline: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Found:
    """What a pid file names: `process` when it is ours and running; otherwise `problem`
    says why not (None when there was no file at all)."""

    record: PidRecord | None
    process: psutil.Process | None
    problem: str | None = None


def identify(pid: int) -> tuple[float, list[str]] | None:
    """The create time and command line of `pid`, or None when it is gone or unreadable."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return p.create_time(), p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def write_pidfile(path: Path, pid: int, **extra: Any) -> PidRecord | None:
    """Record `pid` with its identity; None (and no file) when it already exited."""
    ident = identify(pid)
    if ident is None:
        return None
    record = PidRecord(pid, ident[0], ident[1], dict(extra))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        json.dumps(
            {"pid": pid, "create_time": record.create_time, "cmdline": record.cmdline} | extra
        )
    )
    tmp.replace(path)  # a reader sees the old file or the whole new one
    return record


def read_pidfile(path: Path) -> PidRecord | None:
    """The record, or None when there is no file. Raises ValueError on any other content
    (a bare pid from an older lorastack included: it says nothing about identity)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        pid, created, cmdline = data.pop("pid"), data.pop("create_time"), data.pop("cmdline")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a pid record ({text[:40]!r})") from e
    if not (
        isinstance(pid, int)
        and pid > 0
        and isinstance(created, (int, float))
        and isinstance(cmdline, list)
        and all(isinstance(a, str) for a in cmdline)
    ):
        raise ValueError(f"{path} is not a pid record ({text[:40]!r})")
    return PidRecord(pid, float(created), cmdline, data)


def is_ours(record: PidRecord) -> tuple[psutil.Process | None, str | None]:
    """The running process the record names, or None and why it is not ours."""
    ident = identify(record.pid)
    if ident is None:
        return None, f"pid {record.pid} no longer runs"
    created, cmdline = ident
    if abs(created - record.create_time) > CREATE_TIME_SLACK_S or cmdline != record.cmdline:
        return None, (
            f"pid {record.pid} now belongs to another process ({' '.join(cmdline)[:80]!r}, "
            f"started at {created:.0f}, not {record.create_time:.0f}): left alone"
        )
    try:
        return psutil.Process(record.pid), None
    except psutil.NoSuchProcess:  # exited between the two looks
        return None, f"pid {record.pid} no longer runs"


def find_ours(path: Path, *, remove_stale: bool = True) -> Found:
    """What `path` names; a file that names no process of ours is removed (the caller
    reports `problem`)."""
    try:
        record = read_pidfile(path)
    except ValueError as e:
        if remove_stale:
            path.unlink(missing_ok=True)
        return Found(None, None, f"{e}: removed, nothing signalled")
    if record is None:
        return Found(None, None)
    process, problem = is_ours(record)
    if process is None and remove_stale:
        path.unlink(missing_ok=True)
    return Found(record, process, problem)


def group_members(pgid: int, since: float) -> list[psutil.Process]:
    """Processes in group `pgid` created no earlier than its leader (`since`, epoch s)."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(p.pid) == pgid and p.create_time() >= since - CREATE_TIME_SLACK_S:
                members.append(p)
    return members


def stop_group(found: Found, grace_s: float = 20.0) -> None:
    """SIGTERM the group `found.process` leads, then SIGKILL what is left after `grace_s`.

    The leader was identified a moment ago; while any member of its group lives the
    kernel does not hand its id to a new process, so the group signal reaches only ours.
    Survivors are killed one by one through psutil, which checks each one's identity
    (pid and create time) before it signals.
    """
    leader, record = found.process, found.record
    if leader is None or record is None:
        return
    try:
        leads = os.getpgid(leader.pid) == leader.pid
    except ProcessLookupError:
        return
    members = (group_members(leader.pid, record.create_time) if leads else []) or [leader]
    with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
        if leads:
            os.killpg(leader.pid, signal.SIGTERM)
        else:  # not a group leader: the group is someone else's, signal this process alone
            leader.terminate()
    alive = wait_gone(members, grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    wait_gone(alive, 5.0)  # seconds: SIGKILL cannot be ignored


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `procs` still running after `timeout_s` seconds. A zombie counts as gone,
    and nothing is reaped here: a caller's own child keeps its exit status for its Popen
    (psutil.wait_procs would take it)."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)  # seconds between looks; an exit has no event to wait on here
        alive = [p for p in alive if _running(p)]
    return alive
