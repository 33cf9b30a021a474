"""Saving a checkpoint of the run (every step `checkpoint_every`, a new best, the last
step, a stop), what it keeps for a resume (trainer-state.json) and what a resumed run takes
back from it: the step, the token counters, the wall time of earlier sessions,
the validation losses and the RNG states (the adapter, AdamW and scheduler states load
through trainer.publish.checkpoint.load_into); and the upload of a checkpoint that a killed run
wrote locally but never published. Which checkpoint to resume from, and the refusal when
the run changed, is trainer.publish.publishing.find_resume_point. The recipe keeps the
folder a save returns as its last checkpoint.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.data.preparation import Prepared
from trainer.loop.budget import Meter
from trainer.model import sharding
from trainer.publish import checkpoint, publishing
from trainer.state import Components, Progress, RunPlan


def save_checkpoint(
    plan: RunPlan,
    prep: Prepared,
    components: Components,
    progress: Progress,
    meter: Meter,
    say: Callable[[str], None],
) -> Path:
    """Write (rank 0), publish (a "train" run) and prune the checkpoint of this step; every
    process calls it (an FSDP model is gathered by all). Returns the folder (rank 0's, on
    the other processes)."""
    gathered = sharding.gather(components.train_loss, components.optimizer)  # every process, FSDP
    if not plan.settings.is_main:
        return checkpoint.step_dir(plan.ckpt_root, progress.step)  # rank 0's
    folder = checkpoint.save(
        plan.ckpt_root,
        progress.step,
        components.peft,
        components.optimizer,
        components.scheduler,
        saved_state(progress, plan.batches.steps_per_epoch(), meter.seconds()),
        plan.run_manifest,
        gathered,
    )
    say(f"checkpoint step {progress.step}: {folder}")
    if plan.mode == "train":
        publishing.publish_checkpoint(
            plan, prep, progress.step, folder, progress.val_losses, plan.total_steps
        )
    best = publishing.kept_best(plan.config, progress.val_losses)
    checkpoint.prune(plan.ckpt_root, plan.config.keep_checkpoints, best)
    if plan.settings.kill_after_checkpoint == progress.step:
        kill_for_drill(progress.step, folder, say)
    return folder


def kill_for_drill(step: int, folder: Path, say: Callable[[str], None]) -> None:
    """LORASTACK_KILL_AFTER_CHECKPOINT: die by SIGKILL now, as a lost host would, with no
    cleanup. Only rank 0 saves, so only rank 0 dies; torchrun then ends the others."""
    say(f"kill_after_checkpoint={step}: SIGKILL after {folder}")
    os.kill(os.getpid(), signal.SIGKILL)


def is_saved(last_checkpoint: Path | None, step: int) -> bool:
    """Whether the last checkpoint is of this step."""
    return last_checkpoint is not None and last_checkpoint.name.endswith(f"{step:08d}")


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


def publish_unuploaded(plan: RunPlan, prep: Prepared, folder: Path) -> None:
    """Publish the resume checkpoint when the store lacks it (killed between the local
    write and the upload)."""
    ckpt_name = f"{plan.config.output}/checkpoints"
    if folder.name.removeprefix(checkpoint.PREFIX).lstrip("0") not in prep.store.versions(
        ckpt_name
    ):
        step = int(folder.name.removeprefix(checkpoint.PREFIX))
        # before the steps are planned and the checkpoint's progress restored
        publishing.publish_checkpoint(plan, prep, step, folder, {}, None)


def restore(folder: Path, components: Components) -> Progress:
    """Load the checkpoint into the model, optimizer and scheduler and set the RNG states;
    return the progress it kept: step, counters, wall time and validation losses."""
    state = checkpoint.load_into(
        folder, components.peft, components.optimizer, components.scheduler, components.train_loss
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
