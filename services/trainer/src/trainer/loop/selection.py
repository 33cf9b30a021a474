"""Which checkpoint a run publishes, and when it stops early: pure functions of the
validation losses so far ({step: loss}), so a resumed run, which restores them from its
checkpoint, decides exactly as the uninterrupted run would.

`select: best_val_loss` (the default) publishes the adapter of the evaluation with the
lowest validation loss (the earliest on a tie); `last` the final step's. Early stopping
(HF Trainer's patience and threshold): training stops once `patience` evaluations in a
row failed to beat the best so far by more than `min_delta`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Standing:
    """Where the validation losses stand: the best step and how long since it improved."""

    best_step: int | None  # the evaluation with the lowest loss (None: none yet)
    best_loss: float | None
    stale: int  # evaluations since the last one that improved by more than min_delta


def standing(val_losses: dict[int, float], min_delta: float = 0.0) -> Standing:
    """The best step, its loss and the evaluations since the last improvement."""
    best_step: int | None = None
    best = float("inf")
    stale = 0
    for step in sorted(val_losses):
        loss = val_losses[step]
        stale = 0 if loss < best - min_delta else stale + 1
        if loss < best:
            best, best_step = loss, step
    return Standing(best_step, None if best_step is None else best, stale)


def should_stop(val_losses: dict[int, float], patience: int, min_delta: float) -> bool:
    """Whether early stopping ends the run: `patience` evaluations without improvement."""
    return standing(val_losses, min_delta).stale >= patience


class Selected(NamedTuple):
    """The step whose adapter is published, and why (for the manifest and the log)."""

    step: int
    why: str


def selected_step(val_losses: dict[int, float], select: str, last: int) -> Selected:
    """The step whose adapter is published, and why."""
    best = standing(val_losses)
    if select == "last" or best.best_step is None:
        why = "the last step" + ("" if select == "last" else " (no validation loss to select by)")
        return Selected(last, why)
    final = val_losses.get(last)
    than = f" (the last step, {last}: {final:.4f})" if final is not None else ""
    return Selected(best.best_step, f"lowest validation loss {best.best_loss:.4f}{than}")
