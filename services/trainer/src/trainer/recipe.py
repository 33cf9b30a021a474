"""The training recipe: setup / train / save_checkpoint / finish / cleanup, top to bottom.

`run_training(config, settings, ...)` is the Python API (the CLI and the pipeline call
it). Modes: "train" (publishes `<output>/data`, `<output>/test`, checkpoints and the
adapter), "smoke" (a fixed short batch, a few steps, a verdict; publishes nothing) and
"overfit" (N samples until the loss is under OVERFIT_LOSS; publishes nothing): their
differences live in trainer.loop.modes. The recipe holds the order of the stages; the
state they share is typed: `Prepared` (trainer.data.preparation), and trainer.state's
`Components` (trainer.assembly.build_model) and `Progress` (trainer.publish.resuming
restores it). The stages' pieces live in the subpackages:

    setup     trainer.data (splits, samples, preflight), trainer.assembly (run manifest,
              splits published, memory estimate, components, live metrics),
              trainer.model (loading, compiling, auto-batch, DDP / FSDP)
    train     trainer.loop (gradients, progress lines, evaluation and early stopping,
              stopping on signals and caps)
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
from pathlib import Path
from typing import Any, cast

import torch

from lorastack.manifest import Manifest
from trainer import assembly, compile_ahead
from trainer.config import RunConfig
from trainer.data.batching import Plan, total_steps
from trainer.data.preflight import refuse_unless_ok
from trainer.data.preparation import Prepared, prepare
from trainer.data.samples import end_of_turn_id
from trainer.errors import SmokeFailed
from trainer.loop import evaluation, gradients, modes, progress, stopping
from trainer.loop.live import LiveRun
from trainer.metrics import LogTail, held_bytes, process_age, read_series, write_json
from trainer.model.auto_batch import fit_micro_batch
from trainer.model.distributed import rank0_decides, shut_down
from trainer.model.modeling import resolve_device, use_expandable_segments
from trainer.plotting import Plotter
from trainer.publish import budget, failure, hooks, publishing, resuming
from trainer.publish.completion import TrainResult, record_completion, train_result
from trainer.settings import TrainerSettings
from trainer.state import Components, Progress


class Recipe:
    prep: Prepared  # data, tokenizer and base: setup (trainer.data.preparation.prepare)
    parts: Components  # built by setup (trainer.assembly.build_model)

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
        self.tail = tail
        self.command = command  # how the run was started: the resume command repeats it
        self.config = config
        self.settings = settings
        self.mode = mode
        self.overfit = overfit
        base_dir = settings.resolved_runs_dir / config.output
        self.run_dir = base_dir if mode == "train" else base_dir / mode
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics_dir = self.run_dir / "metrics"
        self.progress = Progress()  # replaced by a resumed run's (trainer.publish.resuming)
        self.stop_signal: int | None = None
        self.old_handlers: dict[int, Any] = {}  # trainer.loop.stopping
        self.device = torch.device("cpu")
        self.start_time = time.monotonic()
        caps = budget.Caps.of(config, settings.world_size)
        self.meter = budget.Meter(caps, clock=clock)  # billed time, all sessions
        # seconds per phase of this session (completion record, last line): imports and
        # set-up before the recipe, data, model, steps, saving and publishing
        self.phases: dict[str, float] = {"startup": process_age()}
        self._lap_at = self.start_time
        self.last_checkpoint: Path | None = None
        self.data_manifest: Manifest | None = None
        self.test_manifest: Manifest | None = None
        self.memory_estimate: dict[str, int] = {}
        self.checkpointed = 0  # decoder layers recomputed in backward (assembly.estimate_memory)
        self.plotter: Plotter | None = None  # rank 0's
        self.memory_marks: dict[str, int] = {}  # trainer.model.memory.against_measured
        self.ahead: compile_ahead.Ahead | None = None  # trainer.compile_ahead's child
        self.live = LiveRun(config.output, 0, None, "", bar=False)  # replaced in setup

    def say(self, line: str, show: bool = True) -> None:
        """Print a progress line (above the progress bar, if any) and keep it for the
        support bundle."""
        show = show and self.settings.is_main  # one voice under torchrun
        if show and self.live.bar is not None:
            self.live.bar.write(line)
        elif show:
            print(line, flush=True)
        self.tail.lines.append(time.strftime("%H:%M:%S ") + line)

    # ---- setup ------------------------------------------------------------------

    def setup(self, *, resume: bool, auto_batch: bool) -> None:
        cfg, settings = self.config, self.settings
        torch.set_num_threads(settings.torch_threads or os.cpu_count() or 1)
        if self.mode != "train":
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if settings.is_main:
            self.plotter = Plotter()

        def compile_early(model_config: dict[str, Any]) -> None:
            self.ahead = compile_ahead.start(
                cfg, settings, self.mode, self.run_dir, model_config, auto_batch
            )

        # each process prepares the data; only rank 0's folder is published
        staging = "splits" if settings.is_main else f"splits-rank{settings.rank}"
        prep = prepare(cfg, settings, self.run_dir / staging, on_base=compile_early)
        encoded = prep.encoded  # lives on only in the samples the mode selects
        self.prep = replace(prep, encoded={})
        self.model_config = prep.model_config
        self.eot = end_of_turn_id(prep.tokenizer)
        pad = prep.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eot
        self.say(prep.report.render())
        refuse_unless_ok(prep.report)
        # smoke and overfit runs adjust steps and schedule
        self.config, self.train_samples, self.val_samples = modes.select_samples(
            cfg, self.mode, self.overfit, encoded["train"], encoded["validation"]
        )
        cfg = self.config

        self.device = resolve_device(cfg.device, settings.local_rank)
        use_expandable_segments(self.device, settings.cuda_alloc_conf)
        if auto_batch:
            self.config = cfg = fit_micro_batch(
                cfg,
                settings,
                self.prep.base_dir,
                self.model_config,
                self.device,
                eot=self.eot,
                seq=self.widest(),
                say=self.say,
            )
        self.run_manifest = assembly.run_manifest(self)
        resume_from = publishing.find_resume_point(self, resume)
        if self.mode == "train" and settings.is_main:
            self.data_manifest, self.test_manifest = assembly.publish_splits(self)
        write_json(self.run_dir / "run-manifest.json", self.run_manifest)
        if resume_from is not None and settings.is_main:
            resuming.publish_unuploaded(self, resume_from)
        self.memory_estimate = assembly.estimate_memory(self)
        self.plan = Plan(
            cfg.seed,
            [s.length for s in self.train_samples],
            cfg.micro_batch,
            cfg.grad_accum,
            cfg.max_seq_len if cfg.packing else None,
        )
        self.total_steps = total_steps(cfg, self.plan.steps_per_epoch())
        if self.mode == "train" and self.meter.caps.any:  # before the model loads
            self.say(publishing.check_budget(self, resume_from))
        self.lap("prepare")
        self.memory_marks["start"] = held_bytes(self.device)
        self.parts, compiling = assembly.build_model(
            cfg,
            settings,
            self.prep.base_dir,
            self.model_config,
            self.device,
            checkpointed=self.checkpointed,
            ahead=self.ahead,
            mode=self.mode,
            total_steps=self.total_steps,
            lap=self.lap,
        )
        self.memory_marks["loaded"] = held_bytes(self.device)
        if resume_from is not None:
            self.progress = resuming.restore(resume_from, self.parts)
            self.meter.hours_before = self.progress.wall_before / 3600
            self.say(f"resumed from {resume_from} at step {self.progress.step}")
        stopping.install_handlers(self)
        self.live = assembly.live_run(self)
        if settings.metrics_port is not None and settings.is_main:
            self.say(f"metrics: http://{settings.metrics_host}:{settings.metrics_port}/metrics")
        self.say(
            f"training {self.parts.trainable:,} LoRA parameters on {self.device} "
            f"({len(self.train_samples)} train / {len(self.val_samples)} validation samples, "
            f"{self.total_steps} steps of {cfg.micro_batch}x{cfg.grad_accum}x{settings.world_size}"
            f"{compiling})",
        )

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._lap_at, 2)
        self._lap_at = now

    def widest(self) -> int:
        """Tokens per row of the widest micro-batch."""
        if self.config.packing:
            return self.config.max_seq_len
        return max(s.length for s in self.train_samples)

    def _step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(
            torch.Tensor,
            self.parts.train_loss(
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
        cfg = self.config
        session_start, session_tokens = time.monotonic(), 0
        world = self.settings.world_size
        session_steps = 0
        # a resumed run that had stopped early
        if self.progress.val_losses and evaluation.early_stop(self):
            return
        self.meter.mark()
        while self.progress.step < self.total_steps:
            t0 = time.monotonic()
            batches, n_sup, step_tokens = gradients.step_batches(
                self.plan, self.train_samples, self.progress.step
            )
            loss_on_device = gradients.accumulate(
                cfg,
                self.settings,
                self.parts,
                self.device,
                self.pad,
                self._step_loss,
                batches,
                n_sup,
            )
            grad_norm, lr = gradients.optimizer_step(self.parts, cfg.max_grad_norm)
            step_loss = float(loss_on_device)  # the first wait for the GPU in this step
            self.memory_marks.setdefault("resting", held_bytes(self.device))
            step = self.progress.advance(step_loss, step_tokens, n_sup)
            session_tokens += step_tokens
            dt = time.monotonic() - t0
            session_steps += 1
            line = self.parts.compiler.after_step(
                self.parts.peft,
                session_steps,
                dt,
                self.total_steps - step,
                lambda choice: rank0_decides(choice, world),
            )
            if line:
                self.say(line)
            if not math.isfinite(step_loss):
                raise SmokeFailed(f"the loss is {step_loss} at step {step}", "lower lr")
            if step % cfg.log_every == 0 or step == self.total_steps:
                progress.log_step(
                    self,
                    step_loss,
                    lr,
                    float(grad_norm),
                    step_tokens,
                    dt,
                    session_start,
                    session_tokens,
                )
            evaluated = bool(self.val_samples) and (
                step % cfg.eval_every == 0 or step == self.total_steps
            )
            if evaluated:
                evaluation.evaluate(self)
            if self.mode == "overfit" and step_loss < modes.OVERFIT_LOSS:
                break
            new_best = evaluated and evaluation.best_step(self) == step
            if (
                step % cfg.checkpoint_every == 0
                or step == self.total_steps
                or (new_best and cfg.select == "best_val_loss")  # the adapter it may publish
            ):
                resuming.save_checkpoint(self)
            if evaluated and evaluation.early_stop(self):
                break
            stopping.stop_if_asked(self)

    # ---- finish -------------------------------------------------------------------

    def finish(self) -> TrainResult:
        cfg = self.config
        self.lap("steps")
        done = publishing.already_finished(self)
        if done is not None:
            return done
        if (
            self.val_samples
            and self.progress.step not in self.progress.val_losses
            and self.progress.step > 0
        ):
            evaluation.evaluate(self)
        resuming.checkpoint_unless_saved(self)
        train_series = read_series(self.metrics_dir, "metrics", "loss")
        plot = self.run_dir / "loss.png"
        if self.plotter is not None:
            self.plotter.plot(
                train_series, self.progress.val_losses, plot, f"{cfg.output} ({self.mode})"
            )
        completion = record_completion(self)
        result = train_result(self, completion)
        result.verdict = modes.verdict(self, train_series)
        if self.mode == "train" and self.settings.is_main:
            completion["selected"] = publishing.select_adapter(self)
            result.adapter = publishing.publish_adapter(self, completion, plot)
            completion["adapter_digest"] = result.adapter.digest
        self.lap("finish")
        completion["phases_s"] = self.phases
        self.say("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()))
        if self.settings.is_main:
            write_json(self.run_dir / "training-complete.json", completion)
        if result.verdict is not None:
            modes.say_verdict(self, result.verdict)
        return result

    def cleanup(self) -> None:
        if self.plotter is not None:
            self.plotter.close()
        if self.ahead is not None:
            self.ahead.stop()
        self.live.close(linger_s=self.settings.metrics_linger_s)
        stopping.restore_handlers(self)
        shut_down(self.settings.world_size)


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
        error = failure.report_failure(recipe, e)
        if error is e:
            raise
        raise error from e
    finally:
        recipe.cleanup()
        logging.getLogger().removeHandler(tail)
    modes.refuse_failed(mode, result.verdict)
    result.hook = hooks.after_success(recipe, result, dict(os.environ))
    return result
