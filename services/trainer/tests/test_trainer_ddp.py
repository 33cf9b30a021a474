"""`torchrun --nproc-per-node 2` trains on the CPU (gloo): the forward goes through DDP
(or FSDP2's sharded layers, distributed: fsdp), the two processes take the micro-batches of
each step between them, and the losses equal one process's with the same global batch;
only rank 0 writes and publishes; killed after a checkpoint, two processes resume exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lorastack.store import open_store
from trainer.records import read_series
from trainer.settings import TrainerSettings

# 5 micro-batches of 2 samples in all: the last step's third micro-batch leaves rank 1
# with a repeat that counts zero (it must still meet rank 0's all-reduce)
# no LoRA dropout: each process draws its own masks, so only dropout-free runs can match
DDP = {"micro_batch": 2, "grad_accum": 2, "max_steps": 3, "checkpoint_every": 1,
       "eval_every": 100, "epochs": 1,
       "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip


def torchrun(config: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        # --standalone: the rendezvous store binds port 0 itself, no port picked ahead and
        # raced for
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "lorastack.cli", "train", str(config), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


def one_process(config: Path) -> None:
    one = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "train", str(config)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]


def same_losses(one: Path, two: Path) -> dict[int, float]:
    """The loss of every step of run folder `two` is `one`'s; returns `two`'s."""
    a = read_series(one / "metrics", "metrics", "loss")
    b = read_series(two / "metrics", "metrics", "loss")
    assert list(a) == list(b) == [1, 2, 3]
    for step in a:  # the same sums, added in another order: measured at most 8.8e-7
        assert b[step] == pytest.approx(a[step], rel=1e-5)  # (bench/trainer/ddp_spread.py)
    return b


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_exactly(
    trainer_env: TrainerSettings, tmp_path: Path, write_config: Callable[..., Path]
) -> None:
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo

    data = tmp_path / "ddp.jsonl"
    write_jsonl(data, make_demo(13, seed=3))
    runs = trainer_env.resolved_runs_dir
    one_process(write_config("ddp-one", data, **DDP))
    out = finish(torchrun(write_config("ddp-two", data, **DDP)))
    assert "training" in out and out.count("published ddp-two/adapter") == 1  # rank 0 alone
    b = same_losses(runs / "ddp-one", runs / "ddp-two")
    assert open_store(trainer_env).versions("ddp-two/adapter") == ["1"]
    assert (runs / "ddp-two" / "splits-rank1").is_dir()  # rank 1 staged its data apart

    # killed after its step-1 checkpoint, then resumed on two processes: bit for bit
    cut = write_config("ddp-cut", data, **DDP)
    killed_after_step_1(cut, runs / "ddp-cut")
    resumed = finish(torchrun(cut, "--resume"))
    assert "resumed from" in resumed
    assert read_series(runs / "ddp-cut" / "metrics", "metrics", "loss") == b


def killed_after_step_1(config: Path, run: Path) -> None:
    """Run two processes that die once the step-1 checkpoint is durable: rank 0 SIGKILLs
    itself there (LORASTACK_KILL_AFTER_CHECKPOINT), torchrun ends rank 1. The trainer
    decides where the run dies, so no timing does."""
    proc = torchrun(config, env={**os.environ, "LORASTACK_KILL_AFTER_CHECKPOINT": "1"})
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0, "the run was not killed:\n" + out[-4000:]
    assert "kill_after_checkpoint=1: SIGKILL" in out, out[-4000:]
    assert (run / "checkpoints" / "step-00000001").is_dir(), out[-4000:]
    assert not (run / "checkpoints" / "step-00000002").exists()
    assert not (run / "training-complete.json").exists()


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_and_resume_exactly(
    trainer_env: TrainerSettings, tmp_path: Path, write_config: Callable[..., Path]
) -> None:
    """distributed: fsdp, 2 processes x micro-batch 2 against 1 process x micro-batch 4 (the
    same 4 samples a step), checkpointed activations: the same losses; the published adapter
    is a normal PEFT one; killed after a checkpoint, two processes resume bit for bit."""
    from safetensors.torch import load_file

    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo

    data = tmp_path / "fsdp.jsonl"
    write_jsonl(data, make_demo(13, seed=3))
    runs = trainer_env.resolved_runs_dir
    # with gradient checkpointing, as a model too big for one GPU trains: the layers'
    # recomputed forwards gather their shards again
    fsdp = {**DDP, "distributed": "fsdp", "gradient_checkpointing": True}
    one = {**DDP, "micro_batch": 4, "grad_accum": 1, "gradient_checkpointing": True}
    one_process(write_config("fsdp-one", data, **one))
    out = finish(torchrun(write_config("fsdp-two", data, **fsdp)))
    assert out.count("published fsdp-two/adapter") == 1  # rank 0 alone
    b = same_losses(runs / "fsdp-one", runs / "fsdp-two")
    val_a = read_series(runs / "fsdp-one" / "metrics", "eval", "val_loss")
    val_b = read_series(runs / "fsdp-two" / "metrics", "eval", "val_loss")
    assert val_b and val_b == pytest.approx(val_a, rel=1e-5)  # evaluated through the shards
    weights = [load_file(runs / n / "adapter" / "adapter_model.safetensors") for n in
               ("fsdp-one", "fsdp-two")]  # fmt: skip
    assert set(weights[0]) == set(weights[1])  # PEFT's names, whole tensors
    for k, w in weights[0].items():
        assert weights[1][k].shape == w.shape
        # AdamW moves each element by ~lr whatever its gradient's size, so an element whose
        # gradient is near zero lands up to 2 x lr x steps (6e-3) apart when the reduction
        # order differs: no elementwise bound holds on every machine. Each tensor as a
        # whole does: |a-b|/|a| measured at most 8.7e-5 (1 vs 2 processes, 1 and 2 threads,
        # bench/trainer/results/2026-12-03-ddp-spread.json); a run that lost one rank's
        # half of every step's samples lands up to 0.57 apart (same file).
        assert float((weights[1][k] - w).norm() / w.norm()) < 1e-3, k

    cut = write_config("fsdp-cut", data, **fsdp)
    killed_after_step_1(cut, runs / "fsdp-cut")
    resumed = finish(torchrun(cut, "--resume"))
    assert "resumed from" in resumed
    assert read_series(runs / "fsdp-cut" / "metrics", "metrics", "loss") == b
    again = load_file(runs / "fsdp-cut" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], w) for k, w in weights[1].items())
