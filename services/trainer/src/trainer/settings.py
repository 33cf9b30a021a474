"""The trainer's one settings class, built once at start and passed down.

Adds to the common settings where runs keep their local files, the process-group facts
`torchrun` exports (WORLD_SIZE, RANK, LOCAL_RANK, how its agent restarts the group; read
here and nowhere else), and whether the user configured CUDA's allocator. Compile caches
live under `cache_dir`/torch-compile.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field

from lorastack.settings import CommonSettings


class TrainerSettings(CommonSettings):
    """The trainer's one settings class: run folders, processes, metrics, built once at start."""

    runs_dir: Path | None = Field(None, description="local run folders; default HOME/runs")
    world_size: int = Field(
        1, ge=1, validation_alias=AliasChoices("WORLD_SIZE", "LORASTACK_WORLD_SIZE")
    )
    rank: int = Field(0, ge=0, validation_alias=AliasChoices("RANK", "LORASTACK_RANK"))
    local_rank: int = Field(
        0, ge=0, validation_alias=AliasChoices("LOCAL_RANK", "LORASTACK_LOCAL_RANK")
    )
    elastic_restarts: int = Field(
        0,
        ge=0,
        validation_alias=AliasChoices("TORCHELASTIC_MAX_RESTARTS"),
        description="torchrun's --max-restarts: how often its agent restarts the group",
    )
    elastic_agent_store: bool = Field(
        False,
        validation_alias=AliasChoices("TORCHELASTIC_USE_AGENT_STORE"),
        description="whether the processes meet through the store torchrun's agent keeps "
        "for every attempt (torch >= 2.5's default; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
        "a new store each attempt)",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve the run's Prometheus metrics on this port"
    )
    metrics_host: str = Field(
        "127.0.0.1", description="address the metrics listen on (0.0.0.0 in a container)"
    )
    metrics_linger_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="keep serving the metrics this long after the run ends, so that "
        "Prometheus scrapes the final values (one scrape interval or more)",
    )
    compile_ahead: bool | None = Field(
        None,
        description="compile the layer graph in a child process while the run prepares its "
        "data and loads its base (trainer.compile_ahead); unset: on CUDA",
    )
    kill_after_checkpoint: int | None = Field(
        None,
        ge=1,
        description="a resume drill: the process SIGKILLs itself once the checkpoint of "
        "this step is durable (and published, for a train run), as a host lost at that "
        "moment would; the run is then resumed with --resume. Tests use it so that no "
        "timing decides where a run dies",
    )
    cuda_alloc_conf: str | None = Field(
        None,
        validation_alias=AliasChoices("PYTORCH_CUDA_ALLOC_CONF"),
        description="the user's CUDA allocator settings; unset = expandable segments",
    )

    @property
    def resolved_runs_dir(self) -> Path:
        return (self.runs_dir or self.home / "runs").expanduser().resolve()

    @property
    def is_main(self) -> bool:
        return self.rank == 0
