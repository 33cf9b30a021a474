"""The multi-node overlay's torchrun command (deploy/k8s/overlays/multi-node-training), run as
two "nodes" on loopback: two torchrun agents of one process each, `--nnodes 2` and a c10d
rendezvous on 127.0.0.1, on the CPU (gloo). Rank 0 dies by SIGKILL after its step-1
checkpoint, as a lost process would; the agents restart the group (`--max-restarts`),
which meets again and continues from that checkpoint (`--resume auto`) to the end. Then
a node lost whole: one agent with its process is SIGKILLed and a new one started in its
place (a pod replaced with the same index); the group meets it and continues.

The arguments and environment are the overlay's own; only the endpoint's host, the
processes per node (its GPUs) and the config path are this machine's. The environment
matters: on torchrun's shared store (its default) a restarted group read the last
attempt's peer addresses and hung in 1 of 9 runs beside two busy loops (pytorch#135712);
the overlay gives each attempt a new store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import yaml

from lorastack.store import open_store
from lorastack_testing.net import free_port
from trainer.records import read_series
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


class Nodes:
    """Torchrun agents ("nodes") of one run, each in its own session (a lost node is
    its whole process group), each writing its log to a file (read while it runs)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], folder: Path) -> None:
        self.name, self.command, self.env, self.folder = name, command, env, folder
        self.agents: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self) -> subprocess.Popen[bytes]:
        log = self.folder / f"node{len(self.agents)}.log"
        with log.open("w") as out:
            agent = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        self.agents.append(agent)
        self.logs.append(log)
        return agent

    def text(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def wait_for(self, line: str, limit_s: float = 600) -> None:
        """Until some node has logged `line` (an event decides, not a time; the limit
        only ends a hung run). Fails at once when every agent has ended."""
        deadline = time.monotonic() + limit_s
        while line not in self.text():
            ended = all(agent.poll() is not None for agent in self.agents)
            assert not ended and time.monotonic() < deadline, self.text()[-4000:]
            time.sleep(0.2)

    def kill(self, agent: subprocess.Popen[bytes]) -> None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=60)

    def stop_all(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                self.kill(agent)


def rendezvous_host(agents: list[subprocess.Popen[bytes]], port: int) -> int:
    """The index of the agent that serves the c10d rendezvous store on `port` (on
    loopback the first to bind it; on Kubernetes pod 0, whose name is the endpoint)."""
    pids = [a.pid for a in agents]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for c in psutil.net_connections(kind="tcp"):
            listens = c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
            if listens and c.pid in pids:
                return pids.index(c.pid)
        time.sleep(0.2)
    raise AssertionError(f"no agent listens on {port}")


def assert_finished_once(nodes: Nodes, trainer_env: TrainerSettings) -> None:
    """Every agent not killed ended well; the run resumed, published once (rank 0 alone)
    and logged each step once."""
    name = nodes.name
    for agent, log in zip(nodes.agents, nodes.logs, strict=True):
        if agent.returncode != -signal.SIGKILL:
            assert agent.returncode == 0, log.read_text()[-4000:]
    every = nodes.text()
    assert "kill_after_checkpoint=1: SIGKILL" in every, every[-4000:]
    assert "resumed from" in every, every[-4000:]
    assert "pytorch/pytorch#135712" not in every  # each attempt met on a new store
    assert every.count(f"published {name}/adapter") == 1
    run = trainer_env.resolved_runs_dir / name
    assert list(read_series(run / "metrics", "metrics", "loss")) == [1, 2, 3]
    assert open_store(trainer_env).versions(f"{name}/adapter") == ["1"]


@pytest.fixture
def two_nodes(
    request: pytest.FixtureRequest, tmp_path: Path, write_config: Callable[..., Path]
) -> Iterator[tuple[Nodes, int]]:
    """The overlay's command for a 3-step run whose rank 0 dies after its step-1
    checkpoint, two agents started; the rendezvous port. Stops what is left. The run is
    named after the test: the store is the session's, and `--resume auto` refuses
    another run's checkpoints of the same name."""
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo

    data = tmp_path / "nodes.jsonl"
    write_jsonl(data, make_demo(13, seed=3))
    name = request.node.name.removeprefix("test_")[:40].replace("_", "-")
    config = write_config(name, data, **RUN)
    port = free_port()
    command = overlay_command(config, port)
    assert command[command.index("--nnodes") + 1] == "2"
    env = {**os.environ, **overlay_env(), "LORASTACK_KILL_AFTER_CHECKPOINT": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    nodes = Nodes(name, command, env, tmp_path)
    nodes.start()
    nodes.start()
    try:
        yield nodes, port
    finally:
        nodes.stop_all()


@pytest.mark.slow
def test_two_nodes_meet_by_c10d_and_resume_after_one_is_killed(
    trainer_env: TrainerSettings, two_nodes: tuple[Nodes, int]
) -> None:
    nodes, _ = two_nodes
    for agent in nodes.agents:
        agent.wait(timeout=600)
    assert_finished_once(nodes, trainer_env)


@pytest.mark.slow
def test_a_replaced_node_joins_the_group_which_resumes(
    trainer_env: TrainerSettings, two_nodes: tuple[Nodes, int]
) -> None:
    """A node lost whole (its agent and process, as a pod on a lost machine) and started
    again in its place, as the Indexed Job does with the same index: the other agent
    restarts its process, the group meets the new node and continues from the step-1
    checkpoint. The node lost is the one that does not serve the rendezvous (on
    Kubernetes pod 0 serves it; losing pod 0 ends the attempt and the Job's restarts plus
    `--resume auto` take over)."""
    nodes, port = two_nodes
    host = rendezvous_host(nodes.agents, port)
    nodes.wait_for("kill_after_checkpoint=1: SIGKILL")
    nodes.kill(nodes.agents[1 - host])
    replacement = nodes.start()
    for agent in (nodes.agents[host], replacement):
        agent.wait(timeout=600)
    assert_finished_once(nodes, trainer_env)


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
