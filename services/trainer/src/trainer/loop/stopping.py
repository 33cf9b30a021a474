"""How a run stops short of its last step, at a checkpoint it can resume from: the cost or
time cap (trainer.loop.budget does the arithmetic) checked before the model loads and
after every step, and SIGTERM or SIGINT; rank 0's clock and rank 0's signal decide for
all processes. This module decides and words the stop (CostCapReached,
TrainingInterrupted); the recipe saves the checkpoint and raises. Early stopping on the
validation loss is trainer.loop.evaluation.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import CostCapReached, TrainingInterrupted
from trainer.loop import budget
from trainer.model.distributed import rank0_decides
from trainer.state import RunPlan


def preflight(plan: RunPlan, meter: budget.Meter, resume_from: Path | None) -> str:
    """The preflight of a capped run (trainer.loop.budget): its line, or PreflightRefused. A
    resumed run counts the steps and hours of its checkpoint (trainer-state.json)."""
    state: dict[str, Any] = {}
    if resume_from is not None:
        state = json.loads((resume_from / "trainer-state.json").read_text())
    return budget.check_preflight(
        meter.caps,
        steps_left=plan.total_steps - int(state.get("step", 0)),
        timing=step_time(plan),
        setup_hours=plan.config.setup_hours,
        hours_so_far=float(state.get("wall_s", 0.0)) / 3600 + meter.hours(),
    )


def step_time(plan: RunPlan) -> tuple[float, str] | None:
    """Seconds per step for the cost estimate: the config's, else the steps this run took
    before it was resumed, else this output's smoke run's per token, times the tokens of
    this run's steps (a smoke run trains a short batch of short samples)."""
    if plan.config.seconds_per_step is not None:
        return plan.config.seconds_per_step, "seconds_per_step in the run config"
    batches = plan.batches
    tokens_per_step = sum(batches.lengths) / max(1, batches.steps_per_epoch())
    return budget.measured_step_time(plan.metrics_dir, "this run") or budget.measured_step_time(
        plan.run_dir / "smoke" / "metrics", "the smoke run", tokens_per_step
    )


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
    """Put back the signal handlers in `old`, and empty it."""
    for sig, handler in old.items():
        signal.signal(sig, handler)
    old.clear()


class StopDecision(NamedTuple):
    """What decide_stop found after a step, the same on every process."""

    signum: int | None  # the signal every process stops on (rank 0's), None: no signal
    caps_over: list[str]  # the caps the next step would pass (rank 0's clock decides)
    stop: bool  # the run stops after this step


def decide_stop(
    plan: RunPlan, meter: budget.Meter, stop_signal: int | None, step: int
) -> StopDecision:
    """Whether the run stops after `step`, on a signal or a cap, decided by rank 0.

    Every process stops after the same step (torchrun passes a signal on to each, not at
    the same instant): the checkpoint of a sharded model is gathered by all. One
    broadcast a step under several processes.
    """
    capped = plan.mode == "train" and meter.caps.any
    mine = (stop_signal, meter.check() if capped else [])
    signum, over = rank0_decides(mine, plan.settings.world_size)  # one broadcast a step
    return StopDecision(signum, over, signum is not None or bool(over and step < plan.total_steps))


def stop_error(
    plan: RunPlan,
    meter: budget.Meter,
    *,
    signum: int | None,
    caps_over: list[str],
    step: int,
    checkpoint: Path | None,
) -> TrainingInterrupted | CostCapReached:
    """What the run raises once the checkpoint of `step` is saved: the signal's stop, else
    the cap's (naming the command that resumes it). `signum` and `caps_over` are a
    StopDecision's."""
    if signum is not None:
        return TrainingInterrupted(
            f"{signal.Signals(signum).name} received: stopped after step {step}; "
            f"checkpoint {checkpoint}",
            "continue with the same command plus --resume",
        )
    return budget.stop_error(
        meter.caps,
        meter,
        caps_over,
        step=step,
        total_steps=plan.total_steps,
        checkpoint_ref=f"{plan.config.output}/checkpoints:{step}",
        command=plan.command,
        setup_hours=plan.config.setup_hours,
    )
