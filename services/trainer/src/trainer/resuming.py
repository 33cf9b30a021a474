"""What a checkpoint keeps of the run for a resume (trainer-state.json) and what a resumed
run takes back from it: the step, the token counters, the wall time of earlier sessions,
the validation losses and the RNG states (the adapter, AdamW and scheduler states load
through trainer.checkpoint.load_into); and the upload of a checkpoint that a killed run
wrote locally but never published. Which checkpoint to resume from, and the refusal when
the run changed, is trainer.publishing.find_resume_point.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import checkpoint, publishing

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def saved_state(r: Recipe) -> dict[str, Any]:
    """What a checkpoint keeps of the run for a resume, besides the step and the model,
    optimizer, scheduler and RNG states (trainer.checkpoint.save): the counters, the wall
    time of all sessions so far and the validation losses."""
    return {
        "epoch": (r.step - 1) // max(1, r.plan.steps_per_epoch()),
        "tokens_seen": r.tokens_seen,
        "supervised_seen": r.supervised_seen,
        "wall_s": r.wall_before + r.meter.seconds(),
        "val_losses": {str(k): v for k, v in r.val_losses.items()},
    }


def publish_unuploaded(r: Recipe, folder: Path) -> None:
    """Publish the resume checkpoint when the store lacks it (killed between the local
    write and the upload)."""
    ckpt_name = f"{r.config.output}/checkpoints"
    if folder.name.removeprefix(checkpoint.PREFIX).lstrip("0") not in r.store.versions(ckpt_name):
        r.step = int(folder.name.removeprefix(checkpoint.PREFIX))
        publishing.publish_checkpoint(r, folder)


def restore(r: Recipe, folder: Path) -> None:
    """Load the checkpoint into the model, optimizer and scheduler; take back its step,
    counters, wall time, validation losses and RNG states."""
    state = checkpoint.load_into(folder, r.peft, r.optimizer, r.scheduler, r.train_loss)
    r.step = int(state["step"])
    r.tokens_seen = int(state.get("tokens_seen", 0))
    r.supervised_seen = int(state.get("supervised_seen", 0))
    r.wall_before = float(state.get("wall_s", 0.0))
    r.meter.hours_before = r.wall_before / 3600
    r.val_losses = {int(k): float(v) for k, v in state.get("val_losses", {}).items()}
    checkpoint.set_rng_states(checkpoint.load_rng(folder))
    r.resumed_at = r.step
    r.say(f"resumed from {folder} at step {r.step}")
