"""The validation split during training: its loss at an evaluation step (written as
metrics/eval-step-N.json, shown, and sent to the live metrics), the best step so far and
early stopping (the arithmetic of both is trainer.loop.selection).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from trainer.data.batching import collate, supervised_count
from trainer.loop.selection import should_stop, standing
from trainer.metrics import write_json
from trainer.model.modeling import batch_loss
from trainer.model.sharding import is_sharded

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def evaluate(r: Recipe) -> float:
    """The validation loss per supervised token at this step, recorded and shown."""
    r.parts.peft.eval()
    total, count = 0.0, 0
    mb = r.config.micro_batch
    # FSDP: only a forward through the root has the root's weights whole
    loss_of = r._step_loss if is_sharded(r.parts.train_loss) else partial(batch_loss, r.parts.peft)
    with torch.no_grad():
        for i in range(0, len(r.val_samples), mb):
            chunk = r.val_samples[i : i + mb]
            batch = {k: v.to(r.device) for k, v in collate(chunk, r.pad).items()}
            total += loss_of(batch).item()
            count += supervised_count(chunk)
    r.parts.peft.train()
    val = total / max(1, count)
    r.progress.val_losses[r.progress.step] = val
    if r.settings.is_main:
        write_json(
            r.metrics_dir / f"eval-step-{r.progress.step}.json",
            {"step": r.progress.step, "val_loss": val},
        )
    r.live.evaluated(r.progress.step, val)
    line = f"eval step {r.progress.step}: validation loss {val:.4f} ({count} supervised tokens)"
    r.say(line)
    return val


def best_step(r: Recipe) -> int | None:
    return standing(r.progress.val_losses).best_step


def early_stop(r: Recipe) -> bool:
    """Whether early_stopping ends the run now (said when it does)."""
    stop = r.config.early_stopping
    if stop is None or not should_stop(r.progress.val_losses, stop.patience, stop.min_delta):
        return False
    best = standing(r.progress.val_losses)
    r.say(
        f"early stopping at step {r.progress.step}: {stop.patience} evaluation(s) in a row "
        f"without a fall of more than {stop.min_delta} in validation loss (best "
        f"{best.best_loss:.4f} at step {best.best_step})"
    )
    return True
