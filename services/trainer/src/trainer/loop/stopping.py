"""How a run stops before its last step, at a checkpoint it can resume from: SIGTERM or
SIGINT (TrainingInterrupted) and a cost or time cap (CostCapReached, trainer.publish.budget; rank
0's clock and rank 0's signal decide for all processes). Early stopping on the validation loss is
trainer.loop.evaluation.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from trainer.errors import TrainingInterrupted
from trainer.model.distributed import rank0_decides
from trainer.publish import publishing, resuming

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def install_handlers(r: Recipe) -> None:
    """SIGTERM and SIGINT set r.stop_signal; the step loop stops after the step."""

    def handler(signum: int, frame: Any) -> None:
        r.stop_signal = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            r.old_handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. called from a worker): no handlers
            pass


def restore_handlers(r: Recipe) -> None:
    for sig, old in r.old_handlers.items():
        signal.signal(sig, old)
    r.old_handlers.clear()


def stop_if_asked(r: Recipe) -> None:
    """After a step: on a signal or a reached cap, checkpoint this step and raise."""
    capped = r.mode == "train" and r.meter.caps.any  # rank 0's clock decides
    over = rank0_decides(r.meter.check(), r.settings.world_size) if capped else []
    # every process stops after the same step (torchrun passes a signal on to each, not
    # at the same instant): the checkpoint of a sharded model is gathered by all
    r.stop_signal = rank0_decides(r.stop_signal, r.settings.world_size)
    if r.stop_signal is not None or (over and r.progress.step < r.total_steps):
        resuming.checkpoint_unless_saved(r)
        if r.stop_signal is None:
            raise publishing.cap_reached(r, over)
        name = signal.Signals(r.stop_signal).name
        raise TrainingInterrupted(
            f"{name} received: stopped after step {r.progress.step}; checkpoint {r.last_checkpoint}",
            "continue with the same command plus --resume",
        )
