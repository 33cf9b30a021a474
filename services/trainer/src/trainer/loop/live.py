"""A run as it happens: Prometheus metrics served while the trainer runs, and a progress
bar on a terminal (plain lines otherwise, as in a log file or a container's output).

`LiveRun` owns both; the recipe calls `step` after each logged optimizer step and
`evaluated` after each validation pass. The metrics (names `lorastack_trainer_*`,
label `run` = the config's output name) are what the Grafana dashboard's training row
plots: step, loss, validation loss, learning rate, tokens/s, tokens and supervised tokens,
GPU memory allocated/reserved, GPU utilisation and power (NVML, where present), ETA, cost
so far and the cost cap. The server starts only when a port is set
(LORASTACK_METRICS_PORT) and stops with the run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.readings import nvml_reading

# (name, help) of each gauge; all carry the label `run`
GAUGES = {
    "step": "optimizer steps done",
    "total_steps": "optimizer steps the run will take",
    "loss": "training loss of the last step (nats per supervised token)",
    "val_loss": "last validation loss (nats per supervised token)",
    "learning_rate": "learning rate of the last step",
    "tokens_per_second": "input tokens (not padding) per second in this session",
    "tokens": "input tokens trained on so far",
    "supervised_tokens": "supervised tokens trained on so far",
    "gpu_memory_allocated_bytes": "peak bytes allocated by torch on the GPU",
    "gpu_memory_reserved_bytes": "peak bytes reserved by torch's caching allocator",
    "gpu_utilization_ratio": "GPU utilisation over NVML's last sample period, 0..1",
    "gpu_power_watts": "GPU power draw (NVML)",
    "eta_seconds": "seconds left at this session's pace",
    "cost": "cost so far (price_per_gpu_hour x GPUs x hours)",
    "max_cost": "the run's cost cap (max_cost; 0 = none)",
    "elapsed_hours": "wall-clock hours so far, every session of the run (max_hours caps it)",
}


def gpu_reading(device: torch.device) -> dict[str, float]:
    """Utilisation (0..1) and power (W) from NVML; empty without a GPU or NVML."""
    nvml = nvml_reading(device)
    if not nvml:
        return {}
    return {"gpu_utilization_ratio": nvml["utilization"], "gpu_power_watts": nvml["power_watts"]}


# step values that are not a series of their own in TensorBoard (its x axis is the step)
NOT_SERIES = ("step", "total_steps", "eta_seconds")


class LiveRun:
    """A run's live view: Prometheus gauges, the progress bar and TensorBoard (rank 0)."""

    def __init__(
        self,
        run: str,
        total_steps: int,
        port: int | None,
        host: str,
        bar: bool | None = None,
        tensorboard: Path | None = None,
        resumed_at: int | None = None,
    ) -> None:
        self.events: Any = None
        if tensorboard is not None:  # report_to: tensorboard
            from tensorboardX import SummaryWriter

            # a resumed run drops what an earlier session logged after its checkpoint
            purge = resumed_at + 1 if resumed_at is not None else None
            self.events = SummaryWriter(str(tensorboard), purge_step=purge, flush_secs=10)
        self.server: Any = None
        self.gauges: dict[str, Any] = {}
        if port is not None:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server

            registry = CollectorRegistry()
            for name, text in GAUGES.items():
                gauge = Gauge(f"lorastack_trainer_{name}", text, ["run"], registry=registry)
                self.gauges[name] = gauge.labels(run=run)
            self.server, _ = start_http_server(port, addr=host, registry=registry)
            self.gauges["total_steps"].set(total_steps)
        self.bar: Any = None
        if bar if bar is not None else sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def step(self, values: dict[str, float], line: str) -> bool:
        """Publish one step's values; True when the caller should print `line` (no bar)."""
        for name, value in values.items():
            if name in self.gauges:
                self.gauges[name].set(value)
        if self.events is not None:
            step = int(values["step"])
            for name, value in values.items():
                if name not in NOT_SERIES:
                    self.events.add_scalar(f"train/{name}", value, step)
        if self.bar is None:
            return True
        self.bar.n = int(values["step"])
        self.bar.set_postfix_str(line.split(" ", 2)[2], refresh=True)
        return False

    def evaluated(self, step: int, val_loss: float) -> None:
        """Show a validation loss: the val_loss gauge and TensorBoard's eval/loss."""
        if "val_loss" in self.gauges:
            self.gauges["val_loss"].set(val_loss)
        if self.events is not None:
            self.events.add_scalar("eval/loss", val_loss, step)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the bar; stop the metrics server after `linger_s` seconds of serving the
        final values (a run shorter than a scrape interval is otherwise never seen)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.server is not None:
            time.sleep(linger_s)
            self.server.shutdown()
            self.server.server_close()
            self.server = None
