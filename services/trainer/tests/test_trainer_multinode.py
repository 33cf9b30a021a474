"""The multi-node overlay's torchrun command (deploy/k8s/overlays/multi-node-training), run as
two "nodes" on loopback: two torchrun agents of one process each, `--nnodes 2` and a c10d
rendezvous on 127.0.0.1, on the CPU (gloo). Rank 0 dies by SIGKILL after its step-1
checkpoint, as a lost node would; the agents restart the group (`--max-restarts`), which
meets again and continues from that checkpoint (`--resume auto`) to the end.

The arguments and environment are the overlay's own; only the endpoint's host, the
processes per node (its GPUs) and the config path are this machine's. The environment
matters: on torchrun's shared store (its default) a restarted group read the last
attempt's peer addresses and hung in 1 of 9 runs beside two busy loops (pytorch#135712);
the overlay gives each attempt a new store."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

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


def overlay_container() -> dict[str, Any]:
    job = yaml.safe_load(OVERLAY.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return cast(dict[str, Any], container)


def overlay_env() -> dict[str, str]:
    """The overlay's literal environment (what torchrun's agent reads)."""
    return {e["name"]: e["value"] for e in overlay_container().get("env", []) if "value" in e}


def overlay_command(config: Path, port: int) -> list[str]:
    """The overlay's container args, for one CPU process per node on loopback."""
    container = overlay_container()
    args: list[str] = list(container["args"])
    assert args[0] == "torchrun"
    local = {"--nproc-per-node": "1", "--rdzv-endpoint": f"127.0.0.1:{port}"}
    for i, arg in enumerate(args[:-1]):
        if arg in local:
            args[i + 1] = local[arg]
    args[args.index("/config/train.yaml")] = str(config)
    return [sys.executable, "-m", "torch.distributed.run", *args[1:]]


@pytest.mark.slow
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
    env = {**os.environ, **overlay_env(), "LORASTACK_KILL_AFTER_CHECKPOINT": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
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
    assert "pytorch/pytorch#135712" not in both  # each attempt met on a new store
    assert both.count("published two-nodes/adapter") == 1  # rank 0 alone, once
    run = trainer_env.resolved_runs_dir / "two-nodes"
    assert list(read_series(run / "metrics", "metrics", "loss")) == [1, 2, 3]
    assert open_store(trainer_env).versions("two-nodes/adapter") == ["1"]


@pytest.mark.parametrize(
    ("world", "restarts", "agent_store", "warned"),
    [
        ("8", "3", "True", True),
        ("8", "3", "False", False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store
        ("8", "0", "True", False),  # no restart
        ("1", "3", "True", False),  # one process
    ],
)
def test_a_restart_on_torchruns_shared_store_is_warned_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch, world: str, restarts: str, agent_store: str, warned: bool
) -> None:
    from trainer.model.distributed import restart_hazard

    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    warning = restart_hazard(TrainerSettings())
    assert (warning is not None) == warned
    if warning:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning and "3 times" in warning


def test_the_overlay_gives_each_attempt_a_new_store() -> None:
    assert overlay_env()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
