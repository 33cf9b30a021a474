"""What a run reports while it trains: the step record (metrics-step-N.json), the step
line or progress bar (with the cost so far) and the live metrics (trainer.loop.live). A failed
run's support memo is trainer.publish.failure.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trainer.loop.live import gpu_reading
from trainer.metrics import (
    memory_now,
    write_json,
)
from trainer.model.memory import human

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def log_step(
    r: Recipe,
    loss: float,
    lr: float,
    grad_norm: float,
    tokens: int,
    dt: float,
    session_start: float,
    session_tokens: int,
) -> None:
    """Write the step record, show the step (line or bar), publish the live metrics."""
    elapsed = time.monotonic() - session_start
    tps = session_tokens / elapsed if elapsed > 0 else 0.0
    steps_done = max(1, len(r.progress.losses))
    eta = (r.total_steps - r.progress.step) * elapsed / steps_done
    mem = memory_now(r.device)
    record = {
        "step": r.progress.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_total": r.progress.tokens_seen,
        "tokens_per_s": tps,
        "step_time_s": dt,
        **mem,
    }
    if r.settings.is_main:
        write_json(r.metrics_dir / f"metrics-step-{r.progress.step}.json", record)
    shown = mem.get("peak_allocated", mem.get("rss", 0))
    cost = r.meter.cost()
    line = (
        f"step {r.progress.step}/{r.total_steps} loss {loss:.4f} lr {lr:.2e} gnorm {grad_norm:.3f} "
        f"tok/s {tps:.0f} step {dt:.2f}s eta {duration(eta)} mem {human(shown)}"
        + (f" cost {cost:.2f}" if r.config.price_per_gpu_hour else "")
        + (f"/{r.config.max_cost:g}" if r.config.max_cost else "")
    )
    values = {
        "step": r.progress.step,
        "loss": loss,
        "learning_rate": lr,
        "tokens_per_second": tps,
        "tokens": r.progress.tokens_seen,
        "supervised_tokens": r.progress.supervised_seen,
        "gpu_memory_allocated_bytes": mem.get("peak_allocated", 0),
        "gpu_memory_reserved_bytes": mem.get("peak_reserved", 0),
        "eta_seconds": eta,
        "cost": cost,
        "max_cost": r.config.max_cost or 0.0,
        "elapsed_hours": r.meter.hours(),
        **gpu_reading(r.device),
    }
    r.say(line, show=r.live.step(values, line))


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
