"""The multi-node overlay's torchrun command (deploy/k8s/overlays/multi-node-training), run as
two "nodes" on loopback: two torchrun agents of one process each, `--nnodes 2` and a c10d
rendezvous on 127.0.0.1, on the CPU (gloo). Rank 0 dies by SIGKILL after its step-1
checkpoint, as a lost node would; the agents restart the group (`--max-restarts`), which
meets again and continues from that checkpoint (`--resume auto`) to the end.

The arguments are the overlay's own; only the endpoint's host, the processes per node
(its GPUs) and the config path are this machine's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from lorastack.store import open_store
from lorastack_testing.net import free_port
from trainer.metrics import read_series
from trainer.settings import TrainerSettings

REPO = Path(__file__).resolve().parents[3]
OVERLAY = REPO / "deploy/k8s/overlays/multi-node-training/trainer-indexed.yaml"
# 3 steps of 2 x 2 samples, a checkpoint after each, no dropout (each process its own masks)
RUN = {"micro_batch": 2, "grad_accum": 2, "max_steps": 3, "checkpoint_every": 1,
       "eval_every": 100, "epochs": 1,
       "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip


def overlay_command(config: Path, port: int) -> list[str]:
    """The overlay's container args, for one CPU process per node on loopback."""
    job = yaml.safe_load(OVERLAY.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args: list[str] = list(container["args"])
    assert args[0] == "torchrun"
    local = {"--nproc-per-node": "1", "--rdzv-endpoint": f"127.0.0.1:{port}"}
    for i, arg in enumerate(args[:-1]):
        if arg in local:
            args[i + 1] = local[arg]
    args[args.index("/config/train.yaml")] = str(config)
    return [sys.executable, "-m", "torch.distributed.run", *args[1:]]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LORASTACK_MULTINODE_TEST") != "1",
    reason="issue 49, open: the restarted group sometimes hangs after it loads the model when"
    " the cores are oversubscribed (beside two busy loops: one run hung 10 minutes, three"
    " more ran past 2 minutes, of 9; unloaded ~35-60 s); run it with"
    " LORASTACK_MULTINODE_TEST=1 (node logs in the test's tmp_path)",
)
def test_two_nodes_meet_by_c10d_and_resume_after_one_is_killed(
    trainer_env: TrainerSettings, tmp_path: Path, write_config: Callable[..., Path]
) -> None:
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo

    data = tmp_path / "nodes.jsonl"
    write_jsonl(data, make_demo(13, seed=3))
    config = write_config("two-nodes", data, **RUN)
    command = overlay_command(config, free_port())
    assert command[command.index("--nnodes") + 1] == "2"
    env = {**os.environ, "LORASTACK_KILL_AFTER_CHECKPOINT": "1", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{i}.log" for i in range(2)]  # read while it runs, if it hangs
    nodes = []
    for log in logs:
        with log.open("w") as out:
            nodes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    for node in nodes:
        node.wait(timeout=600)
    outs = [log.read_text() for log in logs]
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 0, out[-4000:]
    both = "\n".join(outs)
    assert "kill_after_checkpoint=1: SIGKILL" in both, both[-4000:]
    assert "resumed from" in both, both[-4000:]
    assert both.count("published two-nodes/adapter") == 1  # rank 0 alone, once
    run = trainer_env.resolved_runs_dir / "two-nodes"
    assert list(read_series(run / "metrics", "metrics", "loss")) == [1, 2, 3]
    assert open_store(trainer_env).versions("two-nodes/adapter") == ["1"]
