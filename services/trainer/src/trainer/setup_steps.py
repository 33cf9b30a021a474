"""The steps of a training run's setup, as functions: each takes the values it reads (the
plan as decided so far, the prepared data, `say`) and returns the one part it decides or
builds; none holds or writes the recipe's state.

Owns: what each step asks of the stages (trainer.data, trainer.assembly, trainer.model,
trainer.publish, trainer.compile_ahead). Does not own: their order, the plan built from
what they return, and the session that keeps what must be closed at cleanup (all three are
trainer.recipe.Recipe.setup's).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainer import assembly, compile_ahead
from trainer.config import RunConfig
from trainer.data.batching import max_row_tokens
from trainer.data.preflight import refuse_unless_ok
from trainer.data.preparation import Prepared, prepare
from trainer.loop import budget, modes, stopping
from trainer.loop.live import LiveRun
from trainer.model import distributed
from trainer.model.ahead import Ahead
from trainer.model.auto_batch import fit_micro_batch
from trainer.model.modeling import use_expandable_segments
from trainer.plotting import Plotter
from trainer.publish import publishing, resuming
from trainer.readings import held_bytes
from trainer.records import write_json
from trainer.state import Components, Progress, RunPlan

Say = Callable[[str], None]


class LoadedModel(NamedTuple):
    """What load_model returns: the built model and the bytes held around its load."""

    built: assembly.BuiltModel
    memory_marks: dict[str, int]  # "start" and "loaded" (trainer.publish.completion)


def prepare_process(plan: RunPlan) -> Plotter | None:
    """Torch threads, a fresh run folder (a smoke or overfit run's) and the CUDA allocator's
    settings; returns rank 0's plotter (None elsewhere)."""
    torch.set_num_threads(plan.settings.torch_threads or os.cpu_count() or 1)
    if plan.mode != "train":
        shutil.rmtree(plan.run_dir, ignore_errors=True)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    plotter = Plotter() if plan.settings.is_main else None
    use_expandable_segments(plan.device, plan.settings.cuda_alloc_conf)
    return plotter


def prepare_data(plan: RunPlan, on_base: Callable[[dict[str, Any]], None]) -> Prepared:
    """The base, splits and encoded samples; `on_base` gets the base's config as soon as it
    is known (the recipe starts compiling ahead then)."""
    # each process prepares the data; only rank 0's folder is published
    is_main, rank = plan.settings.is_main, plan.settings.rank
    staging = plan.run_dir / ("splits" if is_main else f"splits-rank{rank}")
    return prepare(plan.config, plan.settings, staging, on_base=on_base)


def start_compile_ahead(
    plan: RunPlan, model_config: dict[str, Any], *, auto_batch: bool
) -> Ahead | None:
    """The child compiling the layer graph while the data is prepared (trainer.compile_ahead),
    or None where it cannot help."""
    return compile_ahead.start(
        plan.config, plan.settings, plan.mode, plan.run_dir, model_config, plan.device, auto_batch
    )


def select_samples(plan: RunPlan, prep: Prepared, say: Say) -> modes.Selection:
    """The samples the mode trains and validates on (smoke and overfit adjust steps and
    schedule), once the data's preflight passed (else PreflightRefused)."""
    say(prep.report.render())
    refuse_unless_ok(prep.report)
    train, val = prep.encoded["train"], prep.encoded["validation"]
    return modes.select_samples(plan.config, plan.mode, plan.overfit, train, val)


def choose_micro_batch(
    plan: RunPlan,
    prep: Prepared,
    selection: modes.Selection,
    eot: int,
    say: Say,
    *,
    auto_batch: bool,
) -> RunConfig:
    """The config with the micro-batch the GPU fits (--auto-batch), else as selected."""
    if not auto_batch:
        return selection.config
    return fit_micro_batch(
        selection.config,
        plan.settings,
        prep.base_dir,
        prep.model_config,
        plan.device,
        eot=eot,
        seq=max_row_tokens(selection.config, selection.train),
        say=say,
    )


def find_resume_point(
    plan: RunPlan, prep: Prepared, config: RunConfig, run_manifest: dict[str, Any], *, resume: bool
) -> Path | None:
    """The checkpoint a resumed "train" run continues from; refuses a changed run."""
    if plan.mode != "train":
        return None
    return publishing.find_resume_point(
        prep.store, config.output, plan.ckpt_root, run_manifest, resume=resume
    )


def publish_splits(
    plan: RunPlan, prep: Prepared, config: RunConfig
) -> assembly.PublishedSplits | None:
    """`<output>/data` and `<output>/test`, published by rank 0 of a "train" run."""
    if plan.mode == "train" and plan.settings.is_main:
        return assembly.publish_splits(config, prep)
    return None


def plan_memory(
    plan: RunPlan, prep: Prepared, config: RunConfig, selection: modes.Selection, say: Say
) -> assembly.MemoryPlan:
    """The memory estimate and the layers that recompute their activations."""
    return assembly.estimate_memory(
        config,
        plan.settings,
        plan.device,
        prep.model_config,
        seq_len=max_row_tokens(config, selection.train),
        run_dir=plan.run_dir,
        say=say,
    )


def record_plan(
    plan: RunPlan, prep: Prepared, meter: budget.Meter, resume_from: Path | None, say: Say
) -> None:
    """run-manifest.json, the resume checkpoint published where the store lacks it, and a
    capped run's preflight (before the model loads)."""
    write_json(plan.run_dir / "run-manifest.json", plan.run_manifest)
    if resume_from is not None and plan.settings.is_main:
        resuming.publish_unuploaded(plan, prep, resume_from)
    if plan.mode == "train" and meter.caps.any:
        say(stopping.preflight(plan, meter, resume_from))


def load_model(
    plan: RunPlan,
    prep: Prepared,
    ahead: Ahead | None,
    say: Say,
    lap: Callable[[str], None],
) -> LoadedModel:
    """The model, its loss, compiler, optimizer and schedule (trainer.assembly), with the
    bytes held before and after the load. `lap` times the load."""
    hazard = distributed.restart_hazard(plan.settings)
    if hazard:
        say(hazard)
    start = held_bytes(plan.device)
    built = assembly.build_model(
        plan.config,
        plan.settings,
        prep.base_dir,
        prep.model_config,
        plan.device,
        checkpointed=plan.checkpointed,
        ahead=ahead,
        mode=plan.mode,
        total_steps=plan.total_steps,
        lap=lap,
    )
    return LoadedModel(built, {"start": start, "loaded": held_bytes(plan.device)})


def restore_progress(resume_from: Path, components: Components, say: Say) -> Progress:
    """The progress the resume checkpoint kept (its states loaded into the components)."""
    progress = resuming.restore(resume_from, components)
    say(f"resumed from {resume_from} at step {progress.step}")
    return progress


def start_live(plan: RunPlan, resumed_at: int | None, say: Say) -> LiveRun:
    """The live metrics (rank 0 serves them, with the progress bar and TensorBoard)."""
    live = assembly.live_run(plan, resumed_at)
    if plan.settings.metrics_port is not None and plan.settings.is_main:
        host, port = plan.settings.metrics_host, plan.settings.metrics_port
        say(f"metrics: http://{host}:{port}/metrics")
    return live


def start_line(plan: RunPlan, components: Components, compile_note: str) -> str:
    """The start line: LoRA parameters, device, samples, steps and batch shape."""
    cfg = plan.config
    return (
        f"training {components.trainable:,} LoRA parameters on {plan.device} "
        f"({len(plan.train_samples)} train / {len(plan.val_samples)} validation samples, "
        f"{plan.total_steps} steps of {cfg.micro_batch}x{cfg.grad_accum}x"
        f"{plan.settings.world_size}{compile_note})"
    )
