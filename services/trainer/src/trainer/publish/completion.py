"""The end of a run: what `run_training` returns (TrainResult), and the completion record
(training-complete.json, also inside the published adapter): steps, tokens and throughput
over the whole wall time, memory (estimated and measured, part by part), losses,
trainable parameters, billed hours and cost, the device and compile facts. The selected step, adapter digest and phase times are added by
trainer.recipe.Recipe.finish as they become known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lorastack.manifest import Manifest
from trainer.data.preflight import PreflightReport
from trainer.metrics import device_facts, memory_now, nvml_reading, peak_bytes
from trainer.model.compiling import compile_report
from trainer.model.memory import against_measured, human
from trainer.publish.hooks import HookOutcome

if TYPE_CHECKING:
    from trainer.recipe import Recipe


@dataclass
class TrainResult:
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


def train_result(r: Recipe, completion: dict[str, Any]) -> TrainResult:
    """The result of a run that ended with `completion` (the adapter and verdict are set
    by the caller)."""
    return TrainResult(
        r.mode,
        r.run_dir,
        r.progress.step,
        dict(r.progress.losses),
        dict(r.progress.val_losses),
        data=r.data_manifest,
        test=r.test_manifest,
        completion=completion,
        preflight=r.prep.report,
    )


def measured_parts(r: Recipe, peak: int) -> dict[str, int | None]:
    """The parts of trainer.model.memory.PARTS as measured. `r.memory_marks` holds bytes held
    (torch's allocations on a GPU, RSS on the CPU) before the model loads (`start`), after
    it loads (`loaded`) and after the first optimizer step freed its gradients
    (`resting`). On a GPU each part is a difference of those. On the CPU the weights and
    the optimizer state are their tensors' bytes and the step is what the peak held
    beyond them: the weights are mapped from the file and enter the RSS only as they are
    first read, and memory freed after a step stays with the process."""
    marks = r.memory_marks

    def grown(since: str, until: int | None) -> int | None:
        return None if since not in marks or until is None else until - marks[since]

    step, total = grown("resting", peak), grown("start", peak)
    if r.device.type == "cuda":
        return {
            "weights_and_adapter": grown("start", marks.get("loaded")),
            "optimizer": grown("loaded", marks.get("resting")),
            "step": step,
            "total": total,
        }
    held = sum(t.nbytes for t in (*r.parts.peft.parameters(), *r.parts.peft.buffers()))
    state = sum(
        v.nbytes for s in r.parts.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return {
        "weights_and_adapter": held,
        "optimizer": state,
        "step": None if total is None else total - held - state,
        "total": total,
    }


def record_completion(r: Recipe) -> dict[str, Any]:
    """The record of the run as it ends (all sessions of a resumed run); says the memory
    estimate against the measured peak."""
    cfg = r.config
    wall = r.progress.wall_before + r.meter.seconds()
    billed_h = wall / 3600 * r.settings.world_size
    peak = peak_bytes(r.device)
    measured = memory_now(r.device)
    parts = against_measured(r.memory_estimate, measured_parts(r, peak))
    completion = {
        "mode": r.mode,
        "wall_s": round(wall, 3),
        "steps": r.progress.step,
        "tokens": r.progress.tokens_seen,
        "supervised_tokens": r.progress.supervised_seen,
        # over the whole wall time, set-up included: what the bill pays for
        "tokens_per_s": round(r.progress.tokens_seen / wall, 1) if wall > 0 else None,
        "supervised_tokens_per_s": round(r.progress.supervised_seen / wall, 1)
        if wall > 0
        else None,
        "peak_memory": peak,
        "peak_reserved": measured.get("peak_reserved"),
        "memory_estimate": r.memory_estimate.get("total", 0),
        "memory_parts": parts,
        "final_val_loss": r.progress.val_losses.get(r.progress.step),
        "best_val_loss": min(r.progress.val_losses.values()) if r.progress.val_losses else None,
        "final_train_loss": r.progress.losses.get(r.progress.step),
        "trainable_params": r.parts.trainable,
        "billed_hours": billed_h,
        "price_per_gpu_hour": cfg.price_per_gpu_hour,
        "cost": round(billed_h * cfg.price_per_gpu_hour, 6),
        "device": device_facts(r.device),
        "nvml": nvml_reading(r.device) or None,  # the nvidia-smi reading at the end
        "compile": compile_report() if r.parts.compiler.active else None,
    }
    r.say(
        f"memory: estimated {human(r.memory_estimate.get('total', 0))}, measured peak "
        f"{human(peak)} ({'torch allocated' if r.device.type == 'cuda' else 'process RSS'}); "
        + ", ".join(
            f"{name} {human(int(p['estimate'] or 0))} est / "
            + (human(int(p["measured"])) if p["measured"] is not None else "-")
            for name, p in parts.items()
        ),
    )
    return completion
