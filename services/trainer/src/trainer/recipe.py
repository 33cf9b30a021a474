"""The training recipe: setup / train / save_checkpoint / finish / cleanup, top to bottom.

`run_training(config, settings, ...)` is the Python API (the CLI and the pipeline call
it). Modes: "train" (publishes `<output>/data`, `<output>/test`, checkpoints and the
adapter), "smoke" (a fixed short batch, a few steps, a verdict; publishes nothing) and
"overfit" (N samples until the loss is under OVERFIT_LOSS; publishes nothing): their
differences live in trainer.loop.modes. The recipe holds the order of the stages and
the state they share, each part typed: the frozen `RunPlan` (trainer.state: what the
run is and what setup decided, replaced as setup decides), `Prepared`
(trainer.data.preparation), `Components` (trainer.assembly.build_model), `Progress`
(trainer.state; trainer.publish.resuming restores it) and the `Session` (trainer.session:
the log, the meter, the live metrics, the last checkpoint, a stop signal). A stage takes
the values it reads and returns what it makes, which the recipe keeps; no stage imports
this module. The stages live in:

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
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch

from trainer import assembly, compile_ahead
from trainer.config import RunConfig
from trainer.data.batching import Plan, total_steps
from trainer.data.preflight import refuse_unless_ok
from trainer.data.preparation import Prepared, prepare
from trainer.data.samples import end_of_turn_id
from trainer.errors import SmokeFailed
from trainer.loop import budget, evaluation, gradients, modes, progress, stopping
from trainer.loop.live import LiveRun
from trainer.metrics import LogTail, held_bytes, process_age, read_series, write_json
from trainer.model.auto_batch import fit_micro_batch
from trainer.model.distributed import rank0_decides, shut_down
from trainer.model.modeling import resolve_device, use_expandable_segments
from trainer.plotting import Plotter
from trainer.publish import failure, hooks, publishing, resuming
from trainer.publish.completion import TrainResult, record_completion, train_result
from trainer.session import Session
from trainer.settings import TrainerSettings
from trainer.state import Components, Progress, RunPlan


class Recipe:
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
        run_dir = base_dir if mode == "train" else base_dir / mode
        self.plan = RunPlan(config, settings, mode, overfit, command, run_dir)
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
        plan, session = self.plan, self.session
        settings = plan.settings
        torch.set_num_threads(settings.torch_threads or os.cpu_count() or 1)
        if plan.mode != "train":
            shutil.rmtree(plan.run_dir, ignore_errors=True)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        if settings.is_main:
            session.plotter = Plotter()
        device = resolve_device(plan.config.device, settings.local_rank)  # before the data
        use_expandable_segments(device, settings.cuda_alloc_conf)
        self.plan = plan = replace(plan, device=device)

        def compile_early(model_config: dict[str, Any]) -> None:
            session.ahead = compile_ahead.start(
                plan.config, settings, plan.mode, plan.run_dir, model_config, device, auto_batch
            )

        # each process prepares the data; only rank 0's folder is published
        staging = "splits" if settings.is_main else f"splits-rank{settings.rank}"
        prep = prepare(plan.config, settings, plan.run_dir / staging, on_base=compile_early)
        encoded = prep.encoded  # lives on only in the samples the mode selects
        self.prep = prep = replace(prep, encoded={})
        eot, pad = end_of_turn_id(prep.tokenizer), prep.tokenizer.pad_token_id
        session.say(prep.report.render())
        refuse_unless_ok(prep.report)
        # smoke and overfit runs adjust steps and schedule
        cfg, train, val = modes.select_samples(
            plan.config, plan.mode, plan.overfit, encoded["train"], encoded["validation"]
        )
        self.plan = plan = replace(plan, config=cfg, train_samples=train, val_samples=val)
        pad = pad if pad is not None else eot
        self.plan = plan = replace(plan, eot=eot, pad=pad)
        if auto_batch:
            cfg = fit_micro_batch(
                cfg,
                settings,
                prep.base_dir,
                prep.model_config,
                device,
                eot=eot,
                seq=plan.max_row_tokens(),
                say=session.say,
            )
            self.plan = plan = replace(plan, config=cfg)
        self.plan = plan = replace(plan, run_manifest=assembly.run_manifest(plan, prep))
        resume_from = publishing.find_resume_point(plan, prep.store, resume)
        if plan.mode == "train" and settings.is_main:
            splits = assembly.publish_splits(cfg, prep)
            self.plan = plan = replace(plan, data_manifest=splits.data, test_manifest=splits.test)
        write_json(plan.run_dir / "run-manifest.json", plan.run_manifest)
        if resume_from is not None and settings.is_main:
            resuming.publish_unuploaded(plan, prep, resume_from)
        memory = assembly.estimate_memory(plan, prep.model_config, session.say)
        checkpointed = memory.checkpointed
        self.plan = plan = replace(plan, memory_estimate=memory.estimate, checkpointed=checkpointed)
        batches = Plan(
            cfg.seed,
            [sample.length for sample in train],
            cfg.micro_batch,
            cfg.grad_accum,
            cfg.max_seq_len if cfg.packing else None,
        )
        steps = total_steps(cfg, batches.steps_per_epoch())
        self.plan = plan = replace(plan, batches=batches, total_steps=steps)
        if plan.mode == "train" and session.meter.caps.any:  # before the model loads
            session.say(stopping.preflight(plan, session.meter, resume_from))
        session.lap("prepare")
        session.memory_marks["start"] = held_bytes(device)
        built = assembly.build_model(
            cfg,
            settings,
            prep.base_dir,
            prep.model_config,
            device,
            checkpointed=checkpointed,
            ahead=session.ahead,
            mode=plan.mode,
            total_steps=steps,
            lap=session.lap,
        )
        self.components = built.components
        session.memory_marks["loaded"] = held_bytes(device)
        if resume_from is not None:
            self.progress = resuming.restore(resume_from, self.components)
            session.meter.hours_before = self.progress.wall_before / 3600
            session.say(f"resumed from {resume_from} at step {self.progress.step}")
        session.old_handlers = stopping.install_handlers(self._signalled)
        session.live = assembly.live_run(plan, self.progress.resumed_at)
        if settings.metrics_port is not None and settings.is_main:
            session.say(f"metrics: http://{settings.metrics_host}:{settings.metrics_port}/metrics")
        session.say(
            f"training {self.components.trainable:,} LoRA parameters on {device} "
            f"({len(train)} train / {len(val)} validation samples, "
            f"{steps} steps of {cfg.micro_batch}x{cfg.grad_accum}x{settings.world_size}"
            f"{built.compile_note})",
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
        plan, session = self.plan, self.session
        cfg, world = plan.config, plan.settings.world_size
        session_start, session_tokens, session_steps = time.monotonic(), 0, 0
        # a resumed run that had stopped early
        if self.progress.val_losses and evaluation.early_stop(cfg, self.progress, session.say):
            return
        session.meter.mark()
        while self.progress.step < plan.total_steps:
            t0 = time.monotonic()
            batch = gradients.step_batches(plan.batches, plan.train_samples, self.progress.step)
            step_tokens, n_sup = batch.input_tokens, batch.supervised_tokens
            loss_on_device = gradients.accumulate(
                plan, self.components, self._step_loss, batch.micro_batches, n_sup
            )
            grad_norm, lr = gradients.optimizer_step(self.components, cfg.max_grad_norm)
            step_loss = float(loss_on_device)  # one process: the step's first wait for the GPU
            session.memory_marks.setdefault("resting", held_bytes(plan.device))
            step = self.progress.advance(step_loss, step_tokens, n_sup)
            session_tokens += step_tokens
            dt = time.monotonic() - t0
            session_steps += 1
            line = self.components.compiler.after_step(
                self.components.peft,
                session_steps,
                dt,
                plan.total_steps - step,
                lambda choice: rank0_decides(choice, world),
            )
            if line:
                session.say(line)
            if not math.isfinite(step_loss):
                raise SmokeFailed(f"the loss is {step_loss} at step {step}", "lower lr")
            if step % cfg.log_every == 0 or step == plan.total_steps:
                line, values = progress.log_step(
                    plan,
                    self.progress,
                    session.meter,
                    loss=step_loss,
                    lr=lr,
                    grad_norm=float(grad_norm),
                    tokens=step_tokens,
                    step_seconds=dt,
                    session_start=session_start,
                    session_tokens=session_tokens,
                )
                session.say(line, show=session.live.step(values, line))
            evaluated = bool(plan.val_samples) and (
                step % cfg.eval_every == 0 or step == plan.total_steps
            )
            if evaluated:
                self.evaluate()
            if plan.mode == "overfit" and step_loss < modes.OVERFIT_LOSS:
                break
            new_best = evaluated and evaluation.best_step(self.progress.val_losses) == step
            if (
                step % cfg.checkpoint_every == 0
                or step == plan.total_steps
                or (new_best and cfg.select == "best_val_loss")  # the adapter it may publish
            ):
                self.save_checkpoint()
            if evaluated and evaluation.early_stop(cfg, self.progress, session.say):
                break
            self.stop_if_asked()

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
        session = self.session
        session.last_checkpoint = resuming.save_checkpoint(
            self.plan, self.prep, self.components, self.progress, session.meter, session.say
        )

    def checkpoint_unless_saved(self) -> None:
        if not resuming.is_saved(self.session.last_checkpoint, self.progress.step):
            self.save_checkpoint()

    # ---- finish -------------------------------------------------------------------

    def finish(self) -> TrainResult:
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
        completion = record_completion(
            plan, self.components, self.progress, session.meter, session.memory_marks, session.say
        )
        result = train_result(plan, prep, self.progress, completion)
        result.verdict = modes.verdict(
            plan, prep, self.components, self.progress, session.last_checkpoint, train_series
        )
        if plan.mode == "train" and plan.settings.is_main:
            completion["selected"] = publishing.select_adapter(
                plan, prep.store, self.progress, session.say
            )
            result.adapter = publishing.publish_adapter(
                plan, prep, step, completion, plot, session.say
            )
            completion["adapter_digest"] = result.adapter.digest
        session.lap("finish")
        completion["phases_s"] = session.phases
        session.say("time: " + ", ".join(f"{k} {v:.1f} session" for k, v in session.phases.items()))
        if plan.settings.is_main:
            write_json(plan.run_dir / "training-complete.json", completion)
        if result.verdict is not None:
            modes.say_verdict(plan.mode, result.verdict, session.say)
        return result

    def cleanup(self) -> None:
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
        prep = getattr(recipe, "prep", None)  # None: the run failed before its data was ready
        step, session = recipe.progress.step, recipe.session
        error = failure.report_failure(
            recipe.plan, prep, step, session.meter, session.tail, session.say, e
        )
        if error is e:
            raise
        raise error from e
    finally:
        recipe.cleanup()
        logging.getLogger().removeHandler(tail)
    modes.refuse_failed(mode, result.verdict)
    plan, session = recipe.plan, recipe.session
    published = {"adapter": result.adapter, "data": result.data, "test": result.test}
    result.hook = hooks.after_success(
        plan,
        recipe.prep.store,
        recipe.progress.step,
        session.meter,
        published,
        dict(os.environ),
        session.say,
    )
    return result
