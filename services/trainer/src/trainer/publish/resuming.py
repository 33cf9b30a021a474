"""Saving a checkpoint of the run (every step `checkpoint_every`, a new best, the last
step, a stop), what it keeps for a resume (trainer-state.json) and what a resumed run takes
back from it: the step, the token counters, the wall time of earlier sessions,
the validation losses and the RNG states (the adapter, AdamW and scheduler states load
through trainer.publish.checkpoint.load_into); and the upload of a checkpoint that a killed run
wrote locally but never published. Which checkpoint to resume from, and the refusal when
the run changed, is trainer.publish.publishing.find_resume_point.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.model import sharding
from trainer.publish import checkpoint, publishing

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def save_checkpoint(r: Recipe) -> Path | None:
    """Write (rank 0), publish (a "train" run) and prune the checkpoint of this step; every
    process calls it (an FSDP model is gathered by all). Returns the folder on rank 0."""
    gathered = sharding.gather(r.train_loss, r.optimizer)  # every process, FSDP
    if not r.settings.is_main:
        r.last_checkpoint = checkpoint.step_dir(r.ckpt_root, r.step)  # rank 0's
        return None
    folder = checkpoint.save(
        r.ckpt_root,
        r.step,
        r.peft,
        r.optimizer,
        r.scheduler,
        saved_state(r),
        r.run_manifest,
        gathered,
    )
    r.last_checkpoint = folder
    r.say(f"checkpoint step {r.step}: {folder}")
    if r.mode == "train":
        publishing.publish_checkpoint(r, folder)
    checkpoint.prune(r.ckpt_root, r.config.keep_checkpoints, publishing.kept_best(r))
    if r.settings.kill_after_checkpoint == r.step:
        kill_for_drill(r, folder)
    return folder


def kill_for_drill(r: Recipe, folder: Path) -> None:
    """LORASTACK_KILL_AFTER_CHECKPOINT: die by SIGKILL now, as a lost host would, with no
    cleanup. Only rank 0 saves, so only rank 0 dies; torchrun then ends the others."""
    r.say(f"kill_after_checkpoint={r.step}: SIGKILL after {folder}")
    os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_unless_saved(r: Recipe) -> None:
    """Save a checkpoint of this step unless the last one is of this step."""
    if r.last_checkpoint is None or not r.last_checkpoint.name.endswith(f"{r.step:08d}"):
        save_checkpoint(r)


def saved_state(r: Recipe) -> dict[str, Any]:
    """What a checkpoint keeps of the run for a resume, besides the step and the model,
    optimizer, scheduler and RNG states (trainer.publish.checkpoint.save): the counters, the wall
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
