"""The validation split during training: its loss at an evaluation step (written as
metrics/eval-step-N.json, shown, and sent to the live metrics; the recipe records it in
the progress), the best step so far and early stopping (the arithmetic of both is
trainer.loop.selection).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from trainer.config import RunConfig
from trainer.data.batching import collate, supervised_count
from trainer.loop.live import LiveRun
from trainer.loop.selection import should_stop, standing
from trainer.model.modeling import batch_loss
from trainer.model.sharding import is_sharded
from trainer.records import write_json
from trainer.state import Components, Progress, RunPlan


def evaluate(
    plan: RunPlan,
    components: Components,
    step: int,
    step_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    live: LiveRun,
    say: Callable[[str], None],
) -> float:
    """The validation loss per supervised token at `step`, written, sent and said.
    `step_loss` is the training step's loss of a batch (the recipe's)."""
    components.peft.eval()
    total, count = 0.0, 0
    mb = plan.config.micro_batch
    # FSDP: only a forward through the root has the root's weights whole
    loss_of = (
        step_loss if is_sharded(components.train_loss) else partial(batch_loss, components.peft)
    )
    with torch.no_grad():
        for i in range(0, len(plan.val_samples), mb):
            chunk = plan.val_samples[i : i + mb]
            batch = {k: v.to(plan.device) for k, v in collate(chunk, plan.pad).items()}
            total += loss_of(batch).item()
            count += supervised_count(chunk)
    components.peft.train()
    val = total / max(1, count)
    if plan.settings.is_main:
        write_json(plan.metrics_dir / f"eval-step-{step}.json", {"step": step, "val_loss": val})
    live.evaluated(step, val)
    say(f"eval step {step}: validation loss {val:.4f} ({count} supervised tokens)")
    return val


def best_step(val_losses: dict[int, float]) -> int | None:
    """The step whose validation loss is the lowest so far (None before any)."""
    return standing(val_losses).best_step


def early_stop(cfg: RunConfig, progress: Progress, say: Callable[[str], None]) -> bool:
    """Whether early_stopping ends the run now (said when it does)."""
    stop = cfg.early_stopping
    if stop is None or not should_stop(progress.val_losses, stop.patience, stop.min_delta):
        return False
    best = standing(progress.val_losses)
    say(
        f"early stopping at step {progress.step}: {stop.patience} evaluation(s) in a row "
        f"without a fall of more than {stop.min_delta} in validation loss (best "
        f"{best.best_loss:.4f} at step {best.best_step})"
    )
    return True
