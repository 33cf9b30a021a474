"""The end of a run: what `run_training` returns (TrainResult), and the completion record
(training-complete.json, also inside the published adapter): steps, tokens and throughput
over the whole wall time, memory (estimated and measured, part by part), losses,
trainable parameters, billed hours and cost, the device and compile facts. The selected
step and the adapter's sha256 join it where the adapter is published
(trainer.publish.publishing.publish_adapter), the adapter digest and phase times where
trainer.recipe.Recipe.finish writes it; each makes a new dict, none changes the one it got.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorastack.manifest import Manifest
from trainer.data.preflight import PreflightReport
from trainer.data.preparation import Prepared
from trainer.loop.budget import Meter
from trainer.model.compiling import compile_report
from trainer.model.memory import against_measured, human
from trainer.publish.hooks import HookOutcome
from trainer.readings import device_facts, memory_now, nvml_reading, peak_bytes
from trainer.state import Components, Progress, RunPlan


@dataclass(frozen=True)
class TrainResult:
    """What run_training returns: the mode, steps, losses, published artifacts and verdict;
    built once, when the run ends (run_training adds the hook's outcome with a replace)."""

    mode: str
    run_dir: Path
    steps: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    adapter: Manifest | None = None
    data: Manifest | None = None
    test: Manifest | None = None
    completion: dict[str, Any] = field(default_factory=dict)
    verdict: dict[str, Any] | None = None
    preflight: PreflightReport | None = None
    hook: HookOutcome | None = None  # on_complete's, when it ran


def train_result(
    plan: RunPlan,
    prep: Prepared,
    progress: Progress,
    completion: dict[str, Any],
    *,
    adapter: Manifest | None = None,
    verdict: dict[str, Any] | None = None,
) -> TrainResult:
    """The result of a run that ended with `completion`, published `adapter` (a "train"
    run's rank 0) and came to `verdict` (a smoke or overfit run's)."""
    return TrainResult(
        plan.mode,
        plan.run_dir,
        progress.step,
        dict(progress.losses),
        dict(progress.val_losses),
        adapter=adapter,
        data=plan.data_manifest,
        test=plan.test_manifest,
        completion=completion,
        verdict=verdict,
        preflight=prep.report,
    )


def measured_parts(
    device: torch.device, components: Components, marks: dict[str, int], peak: int
) -> dict[str, int | None]:
    """The parts of trainer.model.memory.PARTS as measured. `marks` holds bytes held
    (torch's allocations on a GPU, RSS on the CPU) before the model loads (`start`), after
    it loads (`loaded`) and after the first optimizer step freed its gradients
    (`resting`). On a GPU each part is a difference of those. On the CPU the weights and
    the optimizer state are their tensors' bytes and the step is what the peak held
    beyond them: the weights are mapped from the file and enter the RSS only as they are
    first read, and memory freed after a step stays with the process."""

    def grown(since: str, until: int | None) -> int | None:
        return None if since not in marks or until is None else until - marks[since]

    step, total = grown("resting", peak), grown("start", peak)
    if device.type == "cuda":
        return {
            "weights_and_adapter": grown("start", marks.get("loaded")),
            "optimizer": grown("loaded", marks.get("resting")),
            "step": step,
            "total": total,
        }
    held = sum(t.nbytes for t in (*components.peft.parameters(), *components.peft.buffers()))
    state = sum(
        v.nbytes
        for s in components.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return {
        "weights_and_adapter": held,
        "optimizer": state,
        "step": None if total is None else total - held - state,
        "total": total,
    }


def _memory_line(plan: RunPlan, peak: int, memory: dict[str, dict[str, float | int | None]]) -> str:
    """The estimated memory against the measured `peak` (bytes), in total and per part."""
    device = plan.device
    return (
        f"memory: estimated {human(plan.memory_estimate.get('total', 0))}, measured peak "
        f"{human(peak)} ({'torch allocated' if device.type == 'cuda' else 'process RSS'}); "
        + ", ".join(
            f"{name} {human(int(p['estimate'] or 0))} est / "
            + (human(int(p["measured"])) if p["measured"] is not None else "-")
            for name, p in memory.items()
        )
    )


def record_completion(
    plan: RunPlan,
    components: Components,
    progress: Progress,
    meter: Meter,
    memory_marks: dict[str, int],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The record of the run as it ends (all sessions of a resumed run); says the memory
    estimate against the measured peak. `memory_marks`: see measured_parts."""
    cfg, device = plan.config, plan.device
    wall = progress.wall_before + meter.seconds()
    billed_h = wall / 3600 * plan.settings.world_size
    peak = peak_bytes(device)
    measured = memory_now(device)
    memory = against_measured(
        plan.memory_estimate, measured_parts(device, components, memory_marks, peak)
    )
    completion = {
        "mode": plan.mode,
        "wall_s": round(wall, 3),
        "steps": progress.step,
        "tokens": progress.tokens_seen,
        "supervised_tokens": progress.supervised_seen,
        # over the whole wall time, set-up included: what the bill pays for
        "tokens_per_s": round(progress.tokens_seen / wall, 1) if wall > 0 else None,
        "supervised_tokens_per_s": round(progress.supervised_seen / wall, 1) if wall > 0 else None,
        "peak_memory": peak,
        "peak_reserved": measured.get("peak_reserved"),
        "memory_estimate": plan.memory_estimate.get("total", 0),
        "memory_parts": memory,
        "final_val_loss": progress.val_losses.get(progress.step),
        "best_val_loss": min(progress.val_losses.values()) if progress.val_losses else None,
        "final_train_loss": progress.losses.get(progress.step),
        "trainable_params": components.trainable,
        "billed_hours": billed_h,
        "price_per_gpu_hour": cfg.price_per_gpu_hour,
        "cost": round(billed_h * cfg.price_per_gpu_hour, 6),
        "device": device_facts(device),
        "nvml": nvml_reading(device) or None,  # the nvidia-smi reading at the end
        "compile": compile_report() if components.compiler.active else None,
    }
    say(_memory_line(plan, peak, memory))
    return completion
