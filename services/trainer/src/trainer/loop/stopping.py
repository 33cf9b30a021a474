"""How a run stops before its last step, at a checkpoint it can resume from: SIGTERM or
SIGINT (TrainingInterrupted) and a cost or time cap (CostCapReached, trainer.loop.budget;
rank 0's clock and rank 0's signal decide for all processes). This module decides and
words the stop; the recipe saves the checkpoint and raises. Early stopping on the
validation loss is trainer.loop.evaluation.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.errors import TrainingInterrupted
from trainer.loop.budget import Meter
from trainer.model.distributed import rank0_decides
from trainer.state import RunPlan


def install_handlers(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """SIGTERM and SIGINT call `handler` (the recipe notes the signal; the step loop stops
    after the step); returns the handlers they had, for restore_handlers."""
    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. called from a worker): no handlers
            pass
    return old


def restore_handlers(old: dict[int, Any]) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)
    old.clear()


def asked(
    plan: RunPlan, meter: Meter, stop_signal: int | None, step: int
) -> tuple[int | None, list[str], bool]:
    """After a step: the signal every process stops on (rank 0's), the caps the next step
    would pass (rank 0's clock decides), and whether the run stops here."""
    capped = plan.mode == "train" and meter.caps.any
    over = rank0_decides(meter.check(), plan.settings.world_size) if capped else []
    # every process stops after the same step (torchrun passes a signal on to each, not
    # at the same instant): the checkpoint of a sharded model is gathered by all
    signum = rank0_decides(stop_signal, plan.settings.world_size)
    return signum, over, signum is not None or bool(over and step < plan.total_steps)


def interrupted(signum: int, step: int, checkpoint: Path | None) -> TrainingInterrupted:
    """The stop on a signal, once the checkpoint of this step is saved."""
    name = signal.Signals(signum).name
    return TrainingInterrupted(
        f"{name} received: stopped after step {step}; checkpoint {checkpoint}",
        "continue with the same command plus --resume",
    )
