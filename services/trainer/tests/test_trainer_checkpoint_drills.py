"""Fault drills on checkpoints, each asserting what the user keeps.

- Disk full while a checkpoint is written: a clear error naming the cause, nothing of
  the torn checkpoint left, the previous one intact, and --resume continues from it. The
  fault is injected at the OS boundary: `os.fsync` of the new checkpoint's files answers
  ENOSPC, as a full disk does under delayed allocation (a size-limited tmpfs needs a
  mount, which CI may not allow).
- kill -9 at random points while checkpoints are written, 20 times over one run with a
  checkpoint every step: every resume starts from the newest complete checkpoint on disk,
  and the final adapter equals an uninterrupted run's bit for bit. The points are the
  checkpoint writer's calls at the OS boundary (each `torch.save` into the folder being
  written, each `os.fsync` of it or of the checkpoints folder after the rename), drawn by
  a seeded generator: the child SIGKILLs itself there, so no timing decides.
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import load_config
from trainer.errors import CheckpointWriteFailed
from trainer.publish import checkpoint
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

STEPS = 18  # of the uninterrupted run; the killed one dies once per write point (13 today)


def _adapter(run: Path) -> dict[str, object]:
    return dict(load_file(str(run / "adapter" / "adapter_model.safetensors")))


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fields = {"max_steps": 4, "checkpoint_every": 1, "eval_every": 100, "keep_checkpoints": 2}
    cfg = load_config(write_config("disk-full", demo_jsonl, **fields))
    root = trainer_env.resolved_runs_dir / "disk-full" / "checkpoints"
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:  # the disk fills up while step 3 is written
        if ".tmp-step-00000003" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointWriteFailed) as e:
        run_training(cfg, trainer_env)
    assert "could not write checkpoint step 3" in e.value.message
    assert "the disk is full" in e.value.message and "step 2 is intact" in e.value.message
    assert "free space" in e.value.hint and "--resume" in e.value.hint
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]

    monkeypatch.setattr(os, "fsync", real_fsync)  # space was freed
    result = run_training(cfg, trainer_env, resume=True)
    assert result.completion["steps"] == 4
    assert checkpoint.local_steps(root) == [3, 4]


def _latest_complete(root: Path) -> int | None:
    steps = checkpoint.local_steps(root)
    return max(steps) if steps else None


def _train(cfg: Path, resume: bool, log: Path, kill_at: int = 0) -> None:
    """A training run in this forked child (stdout and stderr to `log`), then exit.
    `kill_at` > 0: SIGKILL itself at that write point of the checkpoints; 0: count them
    and print the count."""
    out = log.open("w", buffering=1)  # line-buffered: what was printed survives a kill
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out  # pytest's capture replaced them in the parent
    points = 0

    def point() -> None:
        nonlocal points
        points += 1
        if points == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    real_fsync, real_save = os.fsync, torch.save

    def fsync(fd: int) -> None:
        if "/checkpoints" in os.readlink(f"/proc/self/fd/{fd}"):  # not the store's files
            point()
        real_fsync(fd)

    def save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        if ".tmp-step-" in str(f):
            point()
        real_save(obj, f, *args, **kwargs)  # type: ignore[arg-type]

    os.fsync, torch.save = fsync, save  # this child's alone: it never returns
    try:
        run_training(load_config(cfg), TrainerSettings(), resume=resume)
    except BaseException as e:  # the parent reads the log
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        os._exit(1)
    print(f"write points: {points}", flush=True)
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_then_resume_is_bitwise_exact(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    """Each run is a forked child of this process (its imports are paid once: a fresh
    interpreter per kill would cost ~10 s of imports), which SIGKILLs itself at one write
    point of its first checkpoint (of its second, in the first run): every write point of
    a checkpoint once, in a seeded order (mid-write, written but not renamed, renamed but
    not yet synced), where 20 random draws could miss one."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    runs = trainer_env.resolved_runs_dir
    steps = STEPS
    fields = {  # one-sample steps of ~75 tokens, a checkpoint after each
        "max_steps": steps,
        "epochs": 2,
        "micro_batch": 1,
        "checkpoint_every": 1,
        "eval_every": 1000,
        "keep_checkpoints": 2,
        "max_seq_len": 96,
    }
    whole = fork.Process(
        target=_train,
        args=(write_config("whole", demo_jsonl, **fields), False, runs.parent / "whole.log"),
    )
    whole.start()
    whole.join(600)
    text = (runs.parent / "whole.log").read_text()
    assert whole.exitcode == 0, text[-2000:]
    counted = re.search(r"write points: (\d+)", text)
    assert counted, text[-2000:]
    per_ckpt = int(counted.group(1)) // steps  # the same files every step
    assert per_ckpt >= 5 and int(counted.group(1)) % steps == 0, counted.group(1)
    # a killed run advances 0 or 1 step (the first 1 or 2): the last resume has steps left
    assert per_ckpt + 2 < steps, per_ckpt
    kill_points = random.Random(1234).sample(range(1, per_ckpt + 1), per_ckpt)

    cfg = write_config("killed", demo_jsonl, **fields)
    ckpts = runs / "killed" / "checkpoints"
    kills, resumes = 0, []
    while True:
        expected = _latest_complete(ckpts)
        log = runs.parent / f"attempt-{kills}.log"
        kill_at = 0
        if kills < per_ckpt:  # the first run: after one complete checkpoint
            kill_at = kill_points[kills] + (per_ckpt if expected is None else 0)
        proc = fork.Process(target=_train, args=(cfg, expected is not None, log, kill_at))
        proc.start()
        proc.join(600)
        text = log.read_text()
        if expected is not None:  # this run resumed: from the newest complete checkpoint
            found = re.search(r"resumed from \S+step-(\d+) at step (\d+)", text)
            assert found, text[-2000:]
            assert int(found.group(1)) == int(found.group(2)) == expected
            resumes.append(expected)
        if proc.exitcode == 0:
            break
        assert proc.exitcode == -signal.SIGKILL, text[-2000:]
        kills += 1
    print(f"kill -9 drill: {kills} kills, resumed from steps {resumes}")
    assert kills == per_ckpt and len(resumes) == per_ckpt, (kills, resumes)
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".trash-*"))
    assert _same(_adapter(runs / "whole"), _adapter(runs / "killed"))
