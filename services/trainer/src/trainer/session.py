"""What one session of a run holds and changes as it goes, beside its frozen plan
(trainer.state.RunPlan) and its progress (trainer.state.Progress): the log tail and
whether this process shows its lines (only the main process does), the meter that bills
the session, the seconds of each phase, the live metrics, rank 0's plotter, the child
compiling ahead, the memory marks, the last checkpoint written, a stop signal received
and the signal handlers it replaced.

Only the recipe (trainer.recipe) holds a Session and changes it; a stage gets the one
thing of it that it uses (`say`, the meter, the live metrics) and returns what it makes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.loop.budget import Meter
    from trainer.loop.live import LiveRun
    from trainer.model.ahead import Ahead
    from trainer.plotting import Plotter
    from trainer.support_bundle import LogTail


@dataclass
class Session:
    """What one session of a run changes as it goes: the log, the meter, the live metrics,
    the last checkpoint, a stop signal."""

    tail: LogTail  # the last log lines, for the support memo
    meter: Meter  # billed time, all sessions
    is_main_process: bool  # rank 0 under torchrun: the one process that shows its lines
    live: LiveRun  # a quiet one until setup starts the real one
    # seconds per phase of this session (completion record, last line): imports and
    # set-up before the recipe, data, model, steps, saving and publishing
    phases: dict[str, float]
    lap_at: float  # time.monotonic() at the end of the last phase
    plotter: Plotter | None = None  # rank 0's
    ahead: Ahead | None = None  # the child compiling ahead (trainer.compile_ahead)
    memory_marks: dict[str, int] = field(default_factory=dict)  # memory.against_measured
    last_checkpoint: Path | None = None
    stop_signal: int | None = None  # SIGTERM or SIGINT received (trainer.loop.stopping)
    old_handlers: dict[int, Any] = field(default_factory=dict)  # restored at cleanup

    def say(self, line: str, show: bool = True) -> None:
        """Print a progress line (above the progress bar, if any) and keep it for the
        support bundle."""
        show = show and self.is_main_process
        if show and self.live.bar is not None:
            self.live.bar.write(line)
        elif show:
            print(line, flush=True)
        self.tail.lines.append(time.strftime("%H:%M:%S ") + line)

    def lap(self, phase: str) -> None:
        """Add the seconds since the last lap to `phase`."""
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.lap_at, 2)
        self.lap_at = now
