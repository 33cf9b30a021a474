"""The steps of the training recipe's setup (trainer.recipe.Recipe.setup), one method
each, each returning the one part it decides or builds; `Recipe.setup` lists them in order
and builds the run's plan once from what they return.

Owns: what each step asks of the stages (trainer.data, trainer.assembly, trainer.model,
trainer.publish, trainer.compile_ahead). Does not own: their order and the plan (recipe.py).
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainer import assembly, compile_ahead
from trainer.config import RunConfig
from trainer.data.batching import max_row_tokens
from trainer.data.preflight import refuse_unless_ok
from trainer.data.preparation import Prepared, prepare
from trainer.data.samples import Sample
from trainer.loop import modes, stopping
from trainer.loop.live import LiveRun
from trainer.metrics import held_bytes, write_json
from trainer.model import distributed
from trainer.model.auto_batch import fit_micro_batch
from trainer.model.modeling import use_expandable_segments
from trainer.plotting import Plotter
from trainer.publish import publishing, resuming
from trainer.session import Session
from trainer.state import Components, Progress, RunPlan


class SetupSteps:
    """The setup steps of a Recipe, over the state the recipe holds."""

    plan: RunPlan
    session: Session
    prep: Prepared
    components: Components
    progress: Progress

    def _setup_process(self) -> None:
        """Torch threads, a fresh run folder (a smoke or overfit run's), rank 0's plotter,
        the CUDA allocator's settings."""
        plan = self.plan
        torch.set_num_threads(plan.settings.torch_threads or os.cpu_count() or 1)
        if plan.mode != "train":
            shutil.rmtree(plan.run_dir, ignore_errors=True)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        if plan.settings.is_main:
            self.session.plotter = Plotter()
        use_expandable_segments(plan.device, plan.settings.cuda_alloc_conf)

    def _setup_data(self, *, auto_batch: bool) -> Prepared:
        """The base, splits and encoded samples (the layer graph starts compiling in a child
        as soon as the base is known)."""
        plan = self.plan
        # each process prepares the data; only rank 0's folder is published
        is_main, rank = plan.settings.is_main, plan.settings.rank
        staging = plan.run_dir / ("splits" if is_main else f"splits-rank{rank}")
        on_base = partial(self._start_compile_ahead, auto_batch=auto_batch)
        return prepare(plan.config, plan.settings, staging, on_base=on_base)

    def _start_compile_ahead(self, model_config: dict[str, Any], *, auto_batch: bool) -> None:
        plan = self.plan
        self.session.ahead = compile_ahead.start(
            plan.config,
            plan.settings,
            plan.mode,
            plan.run_dir,
            model_config,
            plan.device,
            auto_batch,
        )

    def _setup_samples(self, prep: Prepared) -> modes.Selection:
        """The samples the mode trains and validates on (smoke and overfit adjust steps and
        schedule), once the data's preflight passed (else PreflightRefused)."""
        plan = self.plan
        self.session.say(prep.report.render())
        refuse_unless_ok(prep.report)
        train, val = prep.encoded["train"], prep.encoded["validation"]
        return modes.select_samples(plan.config, plan.mode, plan.overfit, train, val)

    def _setup_micro_batch(
        self, selection: modes.Selection, eot: int, *, auto_batch: bool
    ) -> RunConfig:
        """The config with the micro-batch the GPU fits (--auto-batch), else as selected."""
        if not auto_batch:
            return selection.config
        return fit_micro_batch(
            selection.config,
            self.plan.settings,
            self.prep.base_dir,
            self.prep.model_config,
            self.plan.device,
            eot=eot,
            seq=max_row_tokens(selection.config, selection.train),
            say=self.session.say,
        )

    def _setup_resume_point(
        self, config: RunConfig, run_manifest: dict[str, Any], *, resume: bool
    ) -> Path | None:
        """The checkpoint a resumed "train" run continues from; refuses a changed run."""
        if self.plan.mode != "train":
            return None
        store, ckpt_root = self.prep.store, self.plan.ckpt_root
        return publishing.find_resume_point(
            store, config.output, ckpt_root, run_manifest, resume=resume
        )

    def _setup_splits(self, config: RunConfig) -> assembly.PublishedSplits | None:
        """`<output>/data` and `<output>/test`, published by rank 0 of a "train" run."""
        if self.plan.mode == "train" and self.plan.settings.is_main:
            return assembly.publish_splits(config, self.prep)
        return None

    def _setup_memory(self, config: RunConfig, train: list[Sample]) -> assembly.MemoryPlan:
        """The memory estimate and the layers that recompute their activations."""
        plan = self.plan
        return assembly.estimate_memory(
            config,
            plan.settings,
            plan.device,
            self.prep.model_config,
            seq_len=max_row_tokens(config, train),
            run_dir=plan.run_dir,
            say=self.session.say,
        )

    def _record_plan(self, resume_from: Path | None) -> None:
        """run-manifest.json, the resume checkpoint published where the store lacks it, and
        a capped run's preflight (before the model loads)."""
        plan, session = self.plan, self.session
        write_json(plan.run_dir / "run-manifest.json", plan.run_manifest)
        if resume_from is not None and plan.settings.is_main:
            resuming.publish_unuploaded(plan, self.prep, resume_from)
        if plan.mode == "train" and session.meter.caps.any:
            session.say(stopping.preflight(plan, session.meter, resume_from))
        session.lap("prepare")

    def _setup_model(self) -> assembly.BuiltModel:
        """The model, its loss, compiler, optimizer and schedule (trainer.assembly)."""
        plan, prep, session = self.plan, self.prep, self.session
        hazard = distributed.restart_hazard(plan.settings)
        if hazard:
            session.say(hazard)
        session.memory_marks["start"] = held_bytes(plan.device)
        built = assembly.build_model(
            plan.config,
            plan.settings,
            prep.base_dir,
            prep.model_config,
            plan.device,
            checkpointed=plan.checkpointed,
            ahead=session.ahead,
            mode=plan.mode,
            total_steps=plan.total_steps,
            lap=session.lap,
        )
        session.memory_marks["loaded"] = held_bytes(plan.device)
        return built

    def _setup_progress(self, resume_from: Path | None) -> Progress:
        """A fresh run's progress, or the one the resume checkpoint kept (loaded into the
        components)."""
        if resume_from is None:
            return self.progress
        progress = resuming.restore(resume_from, self.components)
        self.session.meter.hours_before = progress.wall_before / 3600
        self.session.say(f"resumed from {resume_from} at step {progress.step}")
        return progress

    def _setup_live(self) -> LiveRun:
        """The live metrics (rank 0 serves them, with the progress bar and TensorBoard)."""
        plan = self.plan
        live = assembly.live_run(plan, self.progress.resumed_at)
        if plan.settings.metrics_port is not None and plan.settings.is_main:
            host, port = plan.settings.metrics_host, plan.settings.metrics_port
            self.session.say(f"metrics: http://{host}:{port}/metrics")
        return live

    def _say_start(self, compile_note: str) -> None:
        """The start line: LoRA parameters, device, samples, steps and batch shape."""
        plan, cfg = self.plan, self.plan.config
        self.session.say(
            f"training {self.components.trainable:,} LoRA parameters on {plan.device} "
            f"({len(plan.train_samples)} train / {len(plan.val_samples)} validation samples, "
            f"{plan.total_steps} steps of {cfg.micro_batch}x{cfg.grad_accum}x"
            f"{plan.settings.world_size}{compile_note})",
        )
