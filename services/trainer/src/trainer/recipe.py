"""The training recipe: setup / train / save_checkpoint / finish / cleanup, top to bottom.

`run_training(config, settings, ...)` is the Python API (the CLI and the pipeline call
it). Modes: "train" (publishes `<output>/data`, `<output>/test`, checkpoints and the
adapter), "smoke" (a fixed short batch, a few steps, a verdict; publishes nothing) and
"overfit" (N samples until the loss is under OVERFIT_LOSS; publishes nothing): their
differences live in trainer.loop.modes. The recipe holds the order of the stages and
the state they share, each part typed: the frozen `RunPlan` (trainer.state: what the
run is, and what setup's steps decided, added once when they have all returned), `Prepared`
(trainer.data.preparation), `Components` (trainer.assembly.build_model), `Progress`
(trainer.state; trainer.publish.resuming restores it) and the `Session` (trainer.session:
the log, the meter, the live metrics, the last checkpoint, a stop signal). A stage takes
the values it reads and returns what it makes, which the recipe keeps; no stage imports
this module. Setup's steps are functions of trainer.setup_steps. The stages live in:

    setup     trainer.data (splits, samples, preflight), trainer.assembly (run manifest,
              splits published, memory estimate, components, live metrics),
              trainer.model (loading, compiling, auto-batch, DDP / FSDP),
              trainer.compile_ahead (the layer graph compiled in a child meanwhile)
    train     trainer.loop (gradients, progress lines, evaluation and early stopping,
              stopping on signals and caps, the meter)
    save      trainer.publish (resuming: what a resume needs; checkpoint: the folder;
              publishing: the store)
    finish    trainer.publish.completion (training-complete.json, the TrainResult),
              trainer.publish.publishing (the selected adapter), trainer.loop.modes
    failure   trainer.publish.failure (support memo, on_failure hook, error mapping)

Exact resume: the data position is the step (batch order derives from (seed, epoch));
a checkpoint restores adapter, AdamW, scheduler and RNG states; `--resume` first
compares the checkpoint's run manifest with this run's and refuses on a difference.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, cast

import torch

from lorastack.errors import LorastackError
from trainer import assembly, setup_steps
from trainer.config import RunConfig
from trainer.data.batching import plan_batches, total_steps
from trainer.data.preparation import Prepared
from trainer.data.samples import special_tokens
from trainer.errors import SmokeFailed
from trainer.loop import budget, evaluation, gradients, modes, progress, stopping
from trainer.loop.live import LiveRun
from trainer.model.distributed import rank0_decides, shut_down
from trainer.model.modeling import resolve_device
from trainer.publish import failure, hooks, publishing, resuming
from trainer.publish.completion import TrainResult, record_completion, train_result
from trainer.readings import held_bytes, process_age
from trainer.records import read_series, write_json
from trainer.session import Session
from trainer.settings import TrainerSettings
from trainer.state import Components, Progress, RunPlan
from trainer.support_bundle import LogTail


class StepDone(NamedTuple):
    """What one optimizer step gave."""

    loss: float  # the step's mean loss per supervised token
    lr: float
    grad_norm: torch.Tensor  # before clipping, on the device: reading it waits for the GPU
    input_tokens: int  # the step's input tokens (not padding)


class Recipe:
    """One run's stages in order (setup, train, save_checkpoint, finish, cleanup) and the
    state they share: the plan, the prepared data, the components, the progress, the
    session."""

    prep: Prepared  # data, tokenizer and base: setup (trainer.data.preparation.prepare)
    components: Components  # built by setup (trainer.assembly.build_model)

    def __init__(
        self,
        config: RunConfig,
        settings: TrainerSettings,
        mode: str,
        overfit: int | None,
        tail: LogTail,
        command: str = "lorastack train CONFIG",
        clock: Callable[[], float] | None = None,
    ) -> None:
        base_dir = settings.resolved_runs_dir / config.output
        self.plan = RunPlan(  # setup adds what it decides (replaced once)
            config=config,
            settings=settings,
            mode=mode,
            overfit=overfit,
            command=command,
            run_dir=base_dir if mode == "train" else base_dir / mode,
            device=resolve_device(config.device, settings.local_rank),
        )
        self.progress = Progress()  # replaced by a resumed run's (trainer.publish.resuming)
        start = time.monotonic()
        self.session = Session(
            tail,
            budget.Meter(budget.Caps.of(config, settings.world_size), clock=clock),
            is_main_process=settings.is_main,
            live=LiveRun(config.output, 0, None, "", bar=False),  # replaced in setup
            phases={"startup": process_age()},
            lap_at=start,
        )

    # ---- setup ------------------------------------------------------------------

    def setup(self, *, resume: bool, auto_batch: bool) -> None:
        """Decide the plan (each step returns its part; the plan is built once from them),
        then publish the splits, build the model and restore a resumed run's checkpoint.
        What cleanup must close (plotter, compile child, live metrics, handlers) goes into
        the session as soon as it exists."""
        plan, session = self.plan, self.session
        session.plotter = setup_steps.prepare_process(plan)
        self.prep = setup_steps.prepare_data(
            plan, on_base=partial(self._start_compile_ahead, auto_batch=auto_batch)
        )
        selection = setup_steps.select_samples(plan, self.prep, session.say)
        self.prep = replace(self.prep, encoded={})  # the samples live on only where selected
        tokens = special_tokens(self.prep.tokenizer)
        config = setup_steps.choose_micro_batch(
            plan, self.prep, selection, tokens.eot, session.say, auto_batch=auto_batch
        )
        run_manifest = assembly.run_manifest(config, plan.settings, plan.device, self.prep)
        resume_from = setup_steps.find_resume_point(
            plan, self.prep, config, run_manifest, resume=resume
        )
        splits = setup_steps.publish_splits(plan, self.prep, config)
        memory = setup_steps.plan_memory(plan, self.prep, config, selection, session.say)
        batches = plan_batches(config, selection.train)
        self.plan = plan = replace(
            plan,
            config=config,
            eot=tokens.eot,
            pad=tokens.pad,
            train_samples=selection.train,
            val_samples=selection.val,
            run_manifest=run_manifest,
            data_manifest=splits.data if splits else None,
            test_manifest=splits.test if splits else None,
            memory_estimate=memory.estimate,
            checkpointed=memory.checkpointed,
            batches=batches,
            total_steps=total_steps(config, batches.steps_per_epoch()),
        )
        setup_steps.record_plan(plan, self.prep, session.meter, resume_from, session.say)
        session.lap("prepare")
        loaded = setup_steps.load_model(plan, self.prep, session.ahead, session.say, session.lap)
        session.memory_marks.update(loaded.memory_marks)
        self.components = loaded.built.components
        if resume_from is not None:
            self.progress = setup_steps.restore_progress(resume_from, self.components, session.say)
            session.meter.hours_before = self.progress.wall_before / 3600
        session.old_handlers = stopping.install_handlers(self._signalled)
        session.live = setup_steps.start_live(plan, self.progress.resumed_at, session.say)
        session.say(setup_steps.start_line(plan, self.components, loaded.built.compile_note))

    def _start_compile_ahead(self, model_config: dict[str, Any], *, auto_batch: bool) -> None:
        """Called once the base is known: the child is kept for cleanup to stop."""
        self.session.ahead = setup_steps.start_compile_ahead(
            self.plan, model_config, auto_batch=auto_batch
        )

    def _signalled(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT: the step loop stops after the step (stop_if_asked)."""
        self.session.stop_signal = signum

    def _step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(
            torch.Tensor,
            self.components.train_loss(
                batch["input_ids"],
                batch.get("attention_mask"),
                batch["labels"],
                batch.get("position_ids"),
                batch.get("cu_seq_lens"),
                batch.get("loss_positions"),
            ),
        )

    # ---- train ------------------------------------------------------------------

    def train(self) -> None:
        """The step loop: from the progress's step to total_steps, or until it stops early."""
        plan, session = self.plan, self.session
        cfg = plan.config
        session_start, session_tokens, session_steps = time.monotonic(), 0, 0
        # a resumed run that had stopped early
        if self.progress.val_losses and evaluation.early_stop(cfg, self.progress, session.say):
            return
        session.meter.mark()
        while self.progress.step < plan.total_steps:
            t0 = time.monotonic()
            step_loss, lr, grad_norm, step_tokens = self._optimizer_step()
            step = self.progress.step
            session_tokens += step_tokens
            dt = time.monotonic() - t0
            session_steps += 1
            self._tell_compiler(session_steps, dt)
            if not math.isfinite(step_loss):
                raise SmokeFailed(f"the loss is {step_loss} at step {step}", "lower lr")
            if self._due(step, cfg.log_every):
                line, values = progress.log_step(
                    plan,
                    self.progress,
                    session.meter,
                    loss=step_loss,
                    lr=lr,
                    grad_norm=float(grad_norm),
                    step_tokens=step_tokens,
                    step_seconds=dt,
                    session_start=session_start,
                    session_tokens=session_tokens,
                )
                session.say(line, show=session.live.step(values, line))
            evaluated = bool(plan.val_samples) and self._due(step, cfg.eval_every)
            if evaluated:
                self.evaluate()
            if plan.mode == "overfit" and step_loss < modes.OVERFIT_LOSS:
                break
            new_best = evaluated and evaluation.best_step(self.progress.val_losses) == step
            # a new best is the adapter it may publish
            if self._due(step, cfg.checkpoint_every) or (
                new_best and cfg.select == "best_val_loss"
            ):
                self.save_checkpoint()
            if evaluated and evaluation.early_stop(cfg, self.progress, session.say):
                break
            self.stop_if_asked()

    def _optimizer_step(self) -> StepDone:
        """One optimizer step over the next batch, the progress advanced past it."""
        plan, components = self.plan, self.components
        batch = gradients.step_batches(plan.batches, plan.train_samples, self.progress.step)
        supervised = batch.supervised_tokens
        loss_on_device = gradients.accumulate(
            plan, components, self._step_loss, batch.micro_batches, supervised
        )
        grad_norm, lr = gradients.optimizer_step(components, plan.config.max_grad_norm)
        step_loss = float(loss_on_device)  # one process: the step's first wait for the GPU
        self.session.memory_marks.setdefault("resting", held_bytes(plan.device))
        self.progress.advance(step_loss, batch.input_tokens, supervised)
        return StepDone(step_loss, lr, grad_norm, batch.input_tokens)

    def _due(self, step: int, every: int) -> bool:
        """Whether something done `every` steps is due at `step` (the last step always is)."""
        return step % every == 0 or step == self.plan.total_steps

    def _tell_compiler(self, session_steps: int, step_seconds: float) -> None:
        """Let the compile run see this step's time (it may switch the compiled graph);
        say what it decided, if anything."""
        line = self.components.compiler.after_step(
            self.components.peft,
            session_steps,
            step_seconds,
            self.plan.total_steps - self.progress.step,
            lambda choice: rank0_decides(choice, self.plan.settings.world_size),
        )
        if line:
            self.session.say(line)

    def evaluate(self) -> None:
        """The validation loss at this step, recorded in the progress."""
        step, session = self.progress.step, self.session
        val = evaluation.evaluate(
            self.plan, self.components, step, self._step_loss, session.live, session.say
        )
        self.progress.val_losses[step] = val

    def stop_if_asked(self) -> None:
        """After a step: on a signal or a reached cap, checkpoint this step and raise."""
        session, step = self.session, self.progress.step
        decision = stopping.decide_stop(self.plan, session.meter, session.stop_signal, step)
        session.stop_signal = decision.signum
        if not decision.stop:
            return
        self.checkpoint_unless_saved()
        raise stopping.stop_error(
            self.plan,
            session.meter,
            signum=decision.signum,
            caps_over=decision.caps_over,
            step=step,
            checkpoint=session.last_checkpoint,
        )

    # ---- save -------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Write this step's checkpoint and publish it."""
        session = self.session
        session.last_checkpoint = resuming.save_checkpoint(
            self.plan, self.prep, self.components, self.progress, session.meter, session.say
        )

    def checkpoint_unless_saved(self) -> None:
        """Save a checkpoint of this step unless one is saved already."""
        if not resuming.is_saved(self.session.last_checkpoint, self.progress.step):
            self.save_checkpoint()

    # ---- finish -------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """Evaluate and checkpoint the last step, record the run, publish the adapter."""
        plan, prep, session = self.plan, self.prep, self.session
        session.lap("steps")
        done = publishing.already_finished(plan, prep, self.progress, session.say)
        if done is not None:
            return done
        step = self.progress.step
        if plan.val_samples and step not in self.progress.val_losses and step > 0:
            self.evaluate()
        self.checkpoint_unless_saved()
        train_series = read_series(plan.metrics_dir, "metrics", "loss")
        plot = plan.run_dir / "loss.png"
        if session.plotter is not None:
            title = f"{plan.config.output} ({plan.mode})"
            session.plotter.plot(train_series, self.progress.val_losses, plot, title)
        record = record_completion(
            plan, self.components, self.progress, session.meter, session.memory_marks, session.say
        )
        verdict = modes.verdict(
            plan, prep, self.components, self.progress, session.last_checkpoint, train_series
        )
        adapter = None
        if plan.mode == "train" and plan.settings.is_main:
            selected = publishing.select_adapter(plan, prep.store, self.progress, session.say)
            published = publishing.publish_adapter(plan, prep, record, selected, plot, session.say)
            adapter = published.manifest
            record = {**published.completion, "adapter_digest": adapter.digest}
        session.lap("finish")
        completion = {**record, "phases_s": session.phases}
        session.say("time: " + ", ".join(f"{k} {v:.1f} session" for k, v in session.phases.items()))
        if plan.settings.is_main:
            write_json(plan.run_dir / "training-complete.json", completion)
        if verdict is not None:
            modes.say_verdict(plan.mode, verdict, session.say)
        return train_result(plan, prep, self.progress, completion, adapter=adapter, verdict=verdict)

    def cleanup(self) -> None:
        """Close what setup opened (plotter, compile child, live metrics, handlers, processes)."""
        session, settings = self.session, self.plan.settings
        if session.plotter is not None:
            session.plotter.close()
        if session.ahead is not None:
            session.ahead.stop()
        session.live.close(linger_s=settings.metrics_linger_s)
        stopping.restore_handlers(session.old_handlers)
        shut_down(settings.world_size)


def run_training(
    config: RunConfig,
    settings: TrainerSettings,
    *,
    smoke: bool = False,
    resume: bool = False,
    overfit: int | None = None,
    auto_batch: bool = False,
    command: str = "lorastack train CONFIG",
    clock: Callable[[], float] | None = None,
) -> TrainResult:
    """Run one training (or smoke / overfit run) end to end; see the module docstring.

    Raises PreflightRefused, ResumeRefused, SmokeFailed (failing verdict),
    TrainingInterrupted (SIGTERM/SIGINT, after a checkpoint), CostCapReached (after a
    checkpoint; the message resumes it: `command` is how the run was started), TrainingOOM
    and TrainingCrashed (both after writing support-bundle.json). `clock` (seconds) bills
    the run; tests give a fake one.
    """
    mode = "smoke" if smoke else "overfit" if overfit is not None else "train"
    tail = LogTail()
    if mode == "train":
        hooks.refuse_local_store(config, settings.resolved_store_url)
    recipe = Recipe(config, settings, mode, overfit, tail, command, clock)
    logging.getLogger().addHandler(tail)
    try:
        recipe.setup(resume=resume and mode == "train", auto_batch=auto_batch)
        recipe.train()
        result = recipe.finish()
    except Exception as e:
        error = _report_failure(recipe, e)
        if error is e:
            raise
        raise error from e
    finally:
        recipe.cleanup()
        logging.getLogger().removeHandler(tail)
    modes.refuse_failed(mode, result.verdict)
    return replace(result, hook=_run_success_hook(recipe, result))


def _report_failure(recipe: Recipe, e: Exception) -> LorastackError:
    """The failed run's memo written (trainer.publish.failure); the error to raise."""
    prep = getattr(recipe, "prep", None)  # None: the run failed before its data was ready
    step, session = recipe.progress.step, recipe.session
    return failure.report_failure(
        recipe.plan, prep, step, session.meter, session.tail, session.say, e
    )


def _run_success_hook(recipe: Recipe, result: TrainResult) -> hooks.HookOutcome | None:
    """Run the config's on_complete hook, if any, with what the run published."""
    plan, session = recipe.plan, recipe.session
    published = {"adapter": result.adapter, "data": result.data, "test": result.test}
    return hooks.after_success(
        plan,
        recipe.prep.store,
        recipe.progress.step,
        session.meter,
        published,
        dict(os.environ),
        session.say,
    )
