"""Fault drills on checkpoints, each asserting what the user keeps.

- Disk full while a checkpoint is written: a clear error naming the cause, nothing of
  the torn checkpoint left, the previous one intact, and --resume continues from it. The
  fault is injected at the OS boundary: `os.fsync` of the new checkpoint's files answers
  ENOSPC, as a full disk does under delayed allocation (a size-limited tmpfs needs a
  mount, which CI may not allow).
- kill -9 at random moments while checkpoints are written, 20 times over one run with a
  checkpoint every step: every resume starts from the newest complete checkpoint on disk,
  and the final adapter equals an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainer import checkpoint
from trainer.config import load_config
from trainer.errors import CheckpointWriteFailed
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

KILLS = 20


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


def _train(cfg: Path, resume: bool, log: Path) -> None:
    """A training run in this forked child (stdout and stderr to `log`), then exit."""
    out = log.open("w", buffering=1)  # line-buffered: what was printed survives a kill
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out  # pytest's capture replaced them in the parent
    try:
        run_training(load_config(cfg), TrainerSettings(), resume=resume)
    except BaseException as e:  # the parent reads the log
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_kill_9_during_checkpoint_writes_then_resume_is_bitwise_exact(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    """Each run is a forked child of this process (its imports are paid once: a fresh
    interpreter per kill would cost ~10 s of imports each, 20 times), SIGKILLed by the
    parent a random 0-30 ms after its first checkpoint write began."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    runs = trainer_env.resolved_runs_dir
    fields = {  # one-sample steps of ~75 tokens, a checkpoint after each
        "max_steps": KILLS + 2,  # a killed run advances 0 or 1 step (the first 1 or 2)
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
    assert whole.exitcode == 0, (runs.parent / "whole.log").read_text()[-2000:]

    cfg = write_config("killed", demo_jsonl, **fields)
    ckpts = runs / "killed" / "checkpoints"
    rng = random.Random(1234)
    kills, resumes = 0, []
    while True:
        expected = _latest_complete(ckpts)
        log = runs.parent / f"attempt-{kills}.log"
        proc = fork.Process(target=_train, args=(cfg, expected is not None, log))
        proc.start()
        if kills < KILLS:
            while proc.is_alive():
                writing = ckpts.is_dir() and any(ckpts.glob(".tmp-*"))
                # a checkpoint write began (the first run: one after a complete checkpoint)
                if writing and (expected is not None or any(ckpts.glob("step-*"))):
                    time.sleep(rng.uniform(0, 0.03))  # mid-write, or just after it
                    os.kill(proc.pid, signal.SIGKILL)
                    kills += 1
                    break
                time.sleep(0.001)
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
    print(f"kill -9 drill: {kills} kills, resumed from steps {resumes}")
    assert kills == KILLS and len(resumes) == KILLS, (kills, resumes)
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".trash-*"))
    assert _same(_adapter(runs / "whole"), _adapter(runs / "killed"))
