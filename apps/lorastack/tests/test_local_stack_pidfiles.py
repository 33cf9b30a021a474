"""`lorastack down / up / status` signal only the processes they started (issue #38).

An unrelated process (a `sleep` in its own session, as `setsid sleep 600` makes one) has
its pid planted in HOME/run/<name>.pid the ways a stale file can name it: a bare pid (an
older lorastack's file), a record whose create time is another process's (the pid was
reused), a record whose command line differs. It must survive, and the file must go. The
test ends the planted process itself; nothing waits on a timer to decide who dies.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lorastack.cli import main as cli_main
from lorastack.pidfile import find_ours, write_pidfile
from lorastack_app.local_stack import SUPERVISOR_PORT, is_ready


@pytest.fixture
def planted() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process in its own session and group, like `setsid sleep 600`."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _plants(proc: subprocess.Popen[bytes]) -> dict[str, str]:
    me = psutil.Process(proc.pid)
    created, cmdline = me.create_time(), me.cmdline()
    record = {"pid": proc.pid, "create_time": created, "cmdline": cmdline}
    server = [sys.executable, "-m", "lorastack.cli", "gateway"]
    return {
        "bare pid": str(proc.pid),
        "reused pid": json.dumps(record | {"create_time": created - 3600.0}),
        "other command": json.dumps(record | {"cmdline": server}),
        "not a record": "{]",
    }


@pytest.mark.parametrize("kind", ["bare pid", "reused pid", "other command", "not a record"])
@pytest.mark.parametrize("name", ["gateway", "inference"])
def test_down_leaves_an_unrelated_process_alone(
    home: Path,
    planted: subprocess.Popen[bytes],
    capsys: pytest.CaptureFixture[str],
    kind: str,
    name: str,
) -> None:
    pidfile = home / "run" / f"{name}.pid"
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text(_plants(planted)[kind])
    assert cli_main(["down"]) == 0
    out, err = capsys.readouterr()
    assert f"{name}: not running" in out and "stopped" not in out
    assert str(pidfile) in err  # reported
    assert not pidfile.exists()  # and removed
    assert planted.poll() is None, "down signalled a process it did not start"
    assert psutil.Process(planted.pid).status() != psutil.STATUS_ZOMBIE


def test_up_and_status_do_not_claim_it(
    home: Path, tmp_path: Path, planted: subprocess.Popen[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    pidfile = home / "run" / "inference.pid"
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text(_plants(planted)["reused pid"])
    assert cli_main(["status", "--gateway-port", "1"]) == 1
    out = capsys.readouterr().out
    assert str(planted.pid) not in out and "starting/unready" not in out
    assert not pidfile.exists()
    pidfile.write_text(_plants(planted)["bare pid"])
    # `up` with a serve config that the service refuses: it must start its own process
    # (which exits with the config's error), not report the planted pid as a running one
    if is_ready(f"http://127.0.0.1:{SUPERVISOR_PORT}/ready"):
        pytest.skip(f"a stack already answers on port {SUPERVISOR_PORT} of this machine")
    config = tmp_path / "serve.yaml"
    config.write_text("not: [a serve config\n")
    assert cli_main(["up", "--serve-config", str(config), "--timeout", "600"]) != 0
    err = capsys.readouterr().err
    assert "runs (pid" not in err and "exited with code" in err
    assert planted.poll() is None


def test_down_stops_what_it_started(home: Path) -> None:
    # a process recorded the way `up` records it is ours: `lorastack down`, run as its own
    # process as a user runs it (so the sleep is not its child), ends the group with SIGTERM
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        pidfile = home / "run" / "gateway.pid"
        assert write_pidfile(pidfile, ours.pid) is not None
        assert find_ours(pidfile, remove_stale=False).process is not None
        down = subprocess.run(
            [sys.executable, "-m", "lorastack.cli", "down"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert down.returncode == 0 and "gateway: stopped" in down.stdout, down
        assert ours.wait() == -signal.SIGTERM and not pidfile.exists()
    finally:
        ours.kill()
        ours.wait()
