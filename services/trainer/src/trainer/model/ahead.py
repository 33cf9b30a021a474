"""The handle on the child process that compiles the run's layer graph ahead
(trainer.compile_ahead starts it): whether it is done, waiting for it until WAIT_S after
its start, and stopping it. trainer.model.compiling.CompileRun steps on eagerly until it
is done, then compiles from the cache it filled.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

WAIT_S = 240.0  # the longest a run steps on eagerly for the child before compiling itself


@dataclass
class Ahead:
    """The child compiling ahead, and where it writes its output."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def finished(self) -> bool:
        """Done, or past its time (wait then stops it)."""
        return self.proc.poll() is not None or time.monotonic() - self.started > WAIT_S

    def wait(self) -> str:
        """Wait for the child (until WAIT_S after its start); a line saying how it went."""
        try:
            code = self.proc.wait(timeout=max(0.0, self.started + WAIT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            return f"compile ahead: still running after {WAIT_S:.0f} s; stopped, compiling here"
        took = time.monotonic() - self.started
        if code != 0:
            return f"compile ahead: failed (exit {code}, see {self.log}); compiling here"
        return f"compile ahead: layer graph compiled in a child process in {took:.0f} s"

    def stop(self) -> None:
        """Kill the child if it still runs, and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
