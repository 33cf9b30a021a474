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
from trainer.state import Components, Progress

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def save_checkpoint(r: Recipe) -> Path | None:
    """Write (rank 0), publish (a "train" run) and prune the checkpoint of this step; every
    process calls it (an FSDP model is gathered by all). Returns the folder on rank 0."""
    gathered = sharding.gather(r.parts.train_loss, r.parts.optimizer)  # every process, FSDP
    if not r.settings.is_main:
        r.last_checkpoint = checkpoint.step_dir(r.ckpt_root, r.progress.step)  # rank 0's
        return None
    folder = checkpoint.save(
        r.ckpt_root,
        r.progress.step,
        r.parts.peft,
        r.parts.optimizer,
        r.parts.scheduler,
        saved_state(r.progress, r.plan.steps_per_epoch(), r.meter.seconds()),
        r.run_manifest,
        gathered,
    )
    r.last_checkpoint = folder
    r.say(f"checkpoint step {r.progress.step}: {folder}")
    if r.mode == "train":
        publishing.publish_checkpoint(r, folder)
    checkpoint.prune(r.ckpt_root, r.config.keep_checkpoints, publishing.kept_best(r))
    if r.settings.kill_after_checkpoint == r.progress.step:
        kill_for_drill(r, folder)
    return folder


def kill_for_drill(r: Recipe, folder: Path) -> None:
    """LORASTACK_KILL_AFTER_CHECKPOINT: die by SIGKILL now, as a lost host would, with no
    cleanup. Only rank 0 saves, so only rank 0 dies; torchrun then ends the others."""
    r.say(f"kill_after_checkpoint={r.progress.step}: SIGKILL after {folder}")
    os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_unless_saved(r: Recipe) -> None:
    """Save a checkpoint of this step unless the last one is of this step."""
    if r.last_checkpoint is None or not r.last_checkpoint.name.endswith(f"{r.progress.step:08d}"):
        save_checkpoint(r)


def saved_state(progress: Progress, steps_per_epoch: int, session_s: float) -> dict[str, Any]:
    """What a checkpoint keeps of the run for a resume, besides the step and the model,
    optimizer, scheduler and RNG states (trainer.publish.checkpoint.save): the counters,
    the wall time of all sessions so far (`session_s`: this session's billed seconds) and
    the validation losses."""
    return {
        "epoch": (progress.step - 1) // max(1, steps_per_epoch),
        "tokens_seen": progress.tokens_seen,
        "supervised_seen": progress.supervised_seen,
        "wall_s": progress.wall_before + session_s,
        "val_losses": {str(k): v for k, v in progress.val_losses.items()},
    }


def publish_unuploaded(r: Recipe, folder: Path) -> None:
    """Publish the resume checkpoint when the store lacks it (killed between the local
    write and the upload)."""
    ckpt_name = f"{r.config.output}/checkpoints"
    if folder.name.removeprefix(checkpoint.PREFIX).lstrip("0") not in r.prep.store.versions(
        ckpt_name
    ):
        r.progress.step = int(folder.name.removeprefix(checkpoint.PREFIX))
        publishing.publish_checkpoint(r, folder)


def restore(folder: Path, parts: Components) -> Progress:
    """Load the checkpoint into the model, optimizer and scheduler and set the RNG states;
    return the progress it kept: step, counters, wall time and validation losses."""
    state = checkpoint.load_into(
        folder, parts.peft, parts.optimizer, parts.scheduler, parts.train_loss
    )
    step = int(state["step"])
    progress = Progress(
        step=step,
        tokens_seen=int(state.get("tokens_seen", 0)),
        supervised_seen=int(state.get("supervised_seen", 0)),
        wall_before=float(state.get("wall_s", 0.0)),
        resumed_at=step,
        val_losses={int(k): float(v) for k, v in state.get("val_losses", {}).items()},
    )
    checkpoint.set_rng_states(checkpoint.load_rng(folder))
    return progress
