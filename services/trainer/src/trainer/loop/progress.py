"""What a run reports while it trains: the step record (metrics-step-N.json), the step
line (with the cost so far) and the values for the live metrics (trainer.loop.live; the
recipe shows the line or the progress bar). A failed run's support memo is
trainer.publish.failure.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from trainer.loop.budget import Meter
from trainer.loop.live import gpu_reading
from trainer.model.memory import human
from trainer.readings import memory_now
from trainer.records import write_json
from trainer.state import Progress, RunPlan


class StepReport(NamedTuple):
    """What log_step reports of a step."""

    line: str  # the step line the recipe shows
    values: dict[str, float]  # the live metrics' values (trainer.loop.live.LiveRun.step)


def log_step(
    plan: RunPlan,
    progress: Progress,
    meter: Meter,
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    step_tokens: int,
    step_seconds: float,
    session_start: float,
    session_tokens: int,
) -> StepReport:
    """Write the step record (rank 0); return the step's line and its live-metric values.

    `step_tokens` are this step's input tokens (not padding), `step_seconds` its wall time;
    `session_start` (time.monotonic()) and `session_tokens` (input tokens of this session's
    steps) are for the throughput and ETA. The run's total is `progress.tokens_seen`.
    """
    elapsed = time.monotonic() - session_start
    tokens_per_s = session_tokens / elapsed if elapsed > 0 else 0.0  # this session's
    steps_done = max(1, len(progress.losses))
    eta = (plan.total_steps - progress.step) * elapsed / steps_done
    mem = memory_now(plan.device)
    record = {
        "step": progress.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": step_tokens,  # this step's (the file's name for it)
        "tokens_total": progress.tokens_seen,
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_seconds,
        **mem,
    }
    if plan.settings.is_main:
        write_json(plan.metrics_dir / f"metrics-step-{progress.step}.json", record)
    cost = meter.cost()
    line = _step_line(plan, record, eta=eta, cost=cost)
    return StepReport(line, _live_values(plan, progress, meter, record, eta=eta, cost=cost))


def _live_values(
    plan: RunPlan,
    progress: Progress,
    meter: Meter,
    record: dict[str, float],
    *,
    eta: float,
    cost: float,
) -> dict[str, float]:
    """The live metrics' values after a step (trainer.loop.live.LiveRun.step), from its
    record: `eta` in seconds, `cost` in the run's currency."""
    return {
        "step": progress.step,
        "loss": record["loss"],
        "learning_rate": record["lr"],
        "tokens_per_second": record["tokens_per_s"],
        "tokens": progress.tokens_seen,  # the run's so far, all sessions (not the step's)
        "supervised_tokens": progress.supervised_seen,
        "gpu_memory_allocated_bytes": record.get("peak_allocated", 0),
        "gpu_memory_reserved_bytes": record.get("peak_reserved", 0),
        "eta_seconds": eta,
        "cost": cost,
        "max_cost": plan.config.max_cost or 0.0,
        "elapsed_hours": meter.hours(),
        **gpu_reading(plan.device),
    }


def _step_line(plan: RunPlan, record: dict[str, float], *, eta: float, cost: float) -> str:
    """The step's line from its record: loss, rate, time left (`eta`, seconds), memory in
    use and the cost so far."""
    memory = record.get("peak_allocated", record.get("rss", 0))
    return (
        f"step {record['step']:.0f}/{plan.total_steps} loss {record['loss']:.4f} "
        f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f} "
        f"tok/s {record['tokens_per_s']:.0f} step {record['step_time_s']:.2f}s "
        f"eta {duration(eta)} mem {human(memory)}"
        + (f" cost {cost:.2f}" if plan.config.price_per_gpu_hour else "")
        + (f"/{plan.config.max_cost:g}" if plan.config.max_cost else "")
    )


def duration(seconds: float) -> str:
    """`seconds` as '1h05m', or '4m09s' under an hour."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
