"""The demo's earlier training run: continued when this code and this config made it,
started afresh when not.

A real user's run that changed is refused by the trainer's resume guard (the run
manifest of its checkpoint against this run, trainer.publish.checkpoint.manifest_diff), and
should be. The demo is a walkthrough on fixed inputs under one output name: a run left
by an older install (other trainer code, libraries or config) is nothing to keep, so
`lorastack demo` clears that run's own checkpoints (in the store and its local run
folder; no other run's) and says so in one line, instead of stopping at the refusal.
What the guard compares and this module cannot know before training (the data's and
the base model's digests, the chat template) is left to the guard.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lorastack.store import ArtifactStore
from trainer.config import RunConfig
from trainer.publish import checkpoint
from trainer.readings import library_versions


def what_changed(old: dict[str, Any], config: RunConfig) -> list[str]:
    """What of the code, libraries and config differs from the run manifest `old` (as
    the resume guard words it: `code_version`, `config.lr`, ...)."""
    now = {
        "code_version": checkpoint.code_version(),
        "libraries": library_versions(),
        "config": config.model_dump(mode="json"),
    }
    kept = {key: old.get(key) for key in now}
    return [line.split(":", 1)[0] for line in checkpoint.manifest_diff(kept, now)]


def continue_or_restart(store: ArtifactStore, runs_dir: Path, config: RunConfig) -> list[str]:
    """The `lorastack train` flags for the demo's run `config.output`: `--resume` when it
    has a checkpoint this code and config made; none for a new run, or after clearing a
    run that other code or another config left (one line says so)."""
    name, local_root = f"{config.output}/checkpoints", runs_dir / config.output / "checkpoints"
    local = checkpoint.local_steps(local_root)
    remote = [int(v) for v in store.versions(name) if v.isdigit()]
    if not local and not remote:
        return []
    latest = max(local + remote)
    folder = checkpoint.step_dir(local_root, latest)
    if latest not in local:
        folder = store.fetch(store.manifest(name, str(latest)))
    try:
        changed = what_changed(checkpoint.read_manifest(folder), config)
    except (OSError, ValueError):  # a checkpoint without a readable run manifest
        changed = ["run-manifest.json unreadable"]
    if not changed:
        return ["--resume"]
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    print(
        f"   the demo's earlier run {config.output!r} (step {latest}) came from other code "
        f"or another config ({shown}): starting it afresh",
        flush=True,
    )
    for version in store.versions(name):
        store.delete(name, version)
    shutil.rmtree(runs_dir / config.output, ignore_errors=True)
    return []
