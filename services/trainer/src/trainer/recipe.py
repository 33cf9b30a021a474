"""The training recipe: setup / train / save_checkpoint / finish / cleanup, top to bottom.

`run_training(config, settings, ...)` is the Python API (the CLI and the pipeline call
it). Modes: "train" (publishes `<output>/data`, `<output>/test`, checkpoints and the
adapter), "smoke" (a fixed short batch, a few steps, a verdict; publishes nothing) and
"overfit" (N samples until the loss is under OVERFIT_LOSS; publishes nothing): their
differences live in trainer.modes. The store (resume point, publishing, the selected
adapter) is trainer.publishing; several processes, trainer.distributed; --auto-batch,
trainer.auto_batch.

Exact resume: the data position is the step (batch order derives from (seed, epoch));
a checkpoint restores adapter, AdamW, scheduler and RNG states; `--resume` first
compares the checkpoint's run manifest with this run's and refuses on a difference.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from lorastack.manifest import Manifest, git_commit
from lorastack.store import ArtifactStore
from trainer import budget, checkpoint, hooks, modes, progress, publishing
from trainer.auto_batch import fit as fit_micro_batch
from trainer.batching import Plan, collate, collate_micro_batch, lr_factor, supervised_count
from trainer.compiling import CompileRun, compile_report, mark_dynamic_width
from trainer.config import RunConfig
from trainer.distributed import my_share, rank0_decides, sum_over_ranks, wrap_ddp
from trainer.errors import SmokeFailed, TrainingInterrupted
from trainer.live import LiveRun
from trainer.memory import estimate, human
from trainer.metrics import (
    LogTail,
    device_facts,
    library_versions,
    memory_now,
    nvml_reading,
    peak_bytes,
    plot_losses,
    process_age,
    read_series,
    warm_plotting,
    write_json,
)
from trainer.modeling import (
    LossModule,
    batch_loss,
    compute_dtype,
    load_model,
    resolve_device,
    use_expandable_segments,
)
from trainer.preflight import PreflightReport, refuse_unless_ok
from trainer.prepare import prepare
from trainer.samples import end_of_turn_id, template_hash
from trainer.selection import should_stop, standing
from trainer.settings import TrainerSettings
from trainer.splits import Splits, publish_once

log = logging.getLogger("trainer")


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
    hook: hooks.HookOutcome | None = None  # on_complete's, when it ran


class Recipe:
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
        self.step = 0
        self.stop_signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self.device = torch.device("cpu")
        self.losses: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.tokens_seen = 0  # input tokens (not padding) in finished steps
        self.supervised_seen = 0  # of those, tokens the loss counted
        self.wall_before = 0.0  # seconds spent in earlier sessions of a resumed run
        self.resumed_at: int | None = None  # the step a resumed run started from
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
        self.report: PreflightReport | None = None
        self.memory_estimate: dict[str, int] = {}
        self.model: Any = None
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
        # each process prepares the data; only rank 0's folder is published
        staging = "splits" if settings.is_main else f"splits-rank{settings.rank}"
        prep = prepare(cfg, settings, self.run_dir / staging)
        self.store: ArtifactStore = prep.store
        self.base, self.base_dir, self.model_config = prep.base, prep.base_dir, prep.model_config
        self.data_dir, self.test_dir = prep.data_dir, prep.test_dir
        self.data_digest, self.test_digest = prep.data_digest, prep.test_digest
        self.tokenizer, self.report, encoded = prep.tokenizer, prep.report, prep.encoded
        splits = prep.splits
        self.eot = end_of_turn_id(self.tokenizer)
        self.pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot
        )
        self.say(self.report.render())
        refuse_unless_ok(self.report)
        self.splits: Splits = splits
        self.train_samples, self.val_samples = modes.select_samples(
            self, encoded["train"], encoded["validation"]
        )
        cfg = self.config  # smoke and overfit runs adjust steps and schedule

        self.device = resolve_device(cfg.device, settings.local_rank)
        use_expandable_segments(self.device, settings.cuda_alloc_conf)
        if auto_batch:
            self.config = cfg = fit_micro_batch(self)
        self.run_manifest = {
            "dataset_digest": self.data_digest,
            "test_digest": self.test_digest,
            "base": {"ref": self.base.ref, "digest": self.base.digest},
            "config_hash": cfg.config_hash(),
            "config": cfg.model_dump(mode="json"),
            "code_version": checkpoint.code_version(),
            "git_commit": git_commit(),
            "libraries": library_versions(),
            "template_hash": template_hash(self.tokenizer),
            "device_type": self.device.type,
            "world_size": settings.world_size,
        }
        resume_from = publishing.find_resume_point(self, resume)
        if self.mode == "train" and settings.is_main:
            self.data_manifest = publish_once(
                self.store,
                self.data_dir,
                f"{cfg.output}/data",
                {"split": splits.counts(), "source": splits.source},
            )
            self.test_manifest = publish_once(
                self.store,
                self.test_dir,
                f"{cfg.output}/test",
                {"frozen_test_of": f"{cfg.output}/data"},
            )
        write_json(self.run_dir / "run-manifest.json", self.run_manifest)
        if resume_from is not None and settings.is_main:
            ckpt_name = f"{cfg.output}/checkpoints"
            if resume_from.name.removeprefix(checkpoint.PREFIX).lstrip(
                "0"
            ) not in self.store.versions(ckpt_name):
                self.step = int(resume_from.name.removeprefix(checkpoint.PREFIX))
                publishing.publish_checkpoint(
                    self, resume_from
                )  # killed between local write and upload

        self.memory_estimate = estimate(
            self.model_config,
            r=cfg.lora.r,
            targets=cfg.lora.target_modules,
            quantization=cfg.quantization,
            compute_bytes=2 if compute_dtype(self.device) == torch.bfloat16 else 4,
            micro_batch=cfg.micro_batch,
            seq_len=self.widest(),
            gradient_checkpointing=cfg.gradient_checkpointing,
        )
        write_json(self.run_dir / "memory-estimate.json", self.memory_estimate)
        self.say(
            "memory estimate: "
            + ", ".join(f"{k} {human(v)}" for k, v in self.memory_estimate.items()),
        )

        self.plan = Plan(
            cfg.seed,
            [s.length for s in self.train_samples],
            cfg.micro_batch,
            cfg.grad_accum,
            cfg.max_seq_len if cfg.packing else None,
        )
        self.total_steps = self._total_steps()
        if self.mode == "train" and self.meter.caps.any:  # before the model loads
            self.say(publishing.check_budget(self, resume_from))
        self._lap("prepare")
        self._seed_everything(cfg.seed)
        self.model = load_model(self.base_dir, cfg, self.device)
        self.peft = self.model
        self.compiler = CompileRun(
            cfg, self.device, self.model_config, settings.resolved_cache_dir / "torch-compile"
        )
        compiling = self.compiler.begin(self.peft)
        self._lap("load_model")
        # training calls the loss through one module; DDP wraps it on several processes
        self.train_loss: Any = LossModule(self.peft)
        if settings.world_size > 1:
            self.train_loss = wrap_ddp(self.train_loss, cfg, settings.world_size, self.device)
        self.model.train()
        params = [p for p in self.peft.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        total, warmup, schedule = self.total_steps, cfg.warmup_steps, cfg.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, warmup, schedule)
        )
        if resume_from is not None:
            state = checkpoint.load_into(resume_from, self.peft, self.optimizer, self.scheduler)
            self.step = int(state["step"])
            self.tokens_seen = int(state.get("tokens_seen", 0))
            self.supervised_seen = int(state.get("supervised_seen", 0))
            self.wall_before = float(state.get("wall_s", 0.0))
            self.meter.hours_before = self.wall_before / 3600
            self.val_losses = {int(k): float(v) for k, v in state.get("val_losses", {}).items()}
            checkpoint.set_rng_states(checkpoint.load_rng(resume_from))
            self.resumed_at = self.step
            self.say(f"resumed from {resume_from} at step {self.step}")
        self._install_signal_handlers()
        self.live = LiveRun(
            cfg.output,
            self.total_steps,
            settings.metrics_port if settings.is_main else None,
            settings.metrics_host,
            bar=None if settings.is_main else False,
            tensorboard=self.run_dir / "tensorboard"
            if "tensorboard" in cfg.report_to and settings.is_main
            else None,
            resumed_at=self.resumed_at,
        )
        if settings.metrics_port is not None and settings.is_main:
            self.say(f"metrics: http://{settings.metrics_host}:{settings.metrics_port}/metrics")
        self.say(
            f"training {self.trainable:,} LoRA parameters on {self.device} "
            f"({len(self.train_samples)} train / {len(self.val_samples)} validation samples, "
            f"{self.total_steps} steps of {cfg.micro_batch}x{cfg.grad_accum}x{settings.world_size}"
            f"{compiling})",
        )

    def _lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._lap_at, 2)
        self._lap_at = now

    def _total_steps(self) -> int:
        cfg = self.config
        by_epochs = cfg.epochs * self.plan.steps_per_epoch()
        return min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs

    def widest(self) -> int:
        """Tokens per row of the widest micro-batch."""
        if self.config.packing:
            return self.config.max_seq_len
        return max(s.length for s in self.train_samples)

    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(
            torch.Tensor,
            self.train_loss(
                batch["input_ids"],
                batch.get("attention_mask"),
                batch["labels"],
                batch.get("position_ids"),
            ),
        )

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. called from a worker): no handlers
                pass

    # ---- train ------------------------------------------------------------------

    def train(self) -> None:
        cfg = self.config
        session_start, session_tokens = time.monotonic(), 0
        world, rank = self.settings.world_size, self.settings.rank
        pack_to = cfg.max_seq_len if cfg.packing else None
        session_steps = 0
        if self.val_losses and self._early_stop():  # a resumed run that had stopped early
            return
        warm_plotting()
        self.meter.mark()
        while self.step < self.total_steps:
            compiled = self.compiler.active
            fixed_rows = cfg.micro_batch if compiled else 0  # few shapes for the compiler
            t0 = time.monotonic()
            batches = [
                [[self.train_samples[i] for i in row] for row in mb]
                for mb in self.plan.step(self.step)
            ]
            flat = [s for mb in batches for row in mb for s in row]
            n_sup = supervised_count(flat)  # the whole step, all ranks
            if n_sup == 0:
                raise SmokeFailed(
                    f"step {self.step + 1} has no supervised token: every label is masked",
                    "check the masking (lorastack data inspect) and loss_on",
                )
            mine = my_share(batches, rank, world)
            step_loss = 0.0
            step_tokens = sum(s.length for s in flat)  # the whole step, all ranks
            for j, (b, weight) in enumerate(mine):
                tensors = collate_micro_batch(b, self.pad, pack_to, fixed_rows)
                batch = {k: v.to(self.device) for k, v in tensors.items()}
                if compiled and pack_to is None:
                    mark_dynamic_width(batch)
                sync_ctx = (
                    self.train_loss.no_sync()
                    if world > 1 and j < len(mine) - 1
                    else contextlib.nullcontext()
                )
                with sync_ctx:
                    # DDP averages gradients over processes: * world gives their sum
                    loss = self._step_loss(batch) / n_sup * world
                    if weight != 1.0:
                        loss = loss * weight
                    loss.backward()
                step_loss += loss.item() / world
            if world > 1:
                step_loss = sum_over_ranks(step_loss, self.device)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.peft.parameters() if p.requires_grad], cfg.max_grad_norm
            )
            lr = float(self.scheduler.get_last_lr()[0])
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.tokens_seen += step_tokens
            self.supervised_seen += n_sup
            session_tokens += step_tokens
            self.losses[self.step] = step_loss
            dt = time.monotonic() - t0
            session_steps += 1
            line = self.compiler.after_step(
                self.peft,
                session_steps,
                dt,
                self.total_steps - self.step,
                lambda choice: rank0_decides(choice, world),
            )
            if line:
                self.say(line)
            if not math.isfinite(step_loss):
                raise SmokeFailed(f"the loss is {step_loss} at step {self.step}", "lower lr")
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
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
                self.step % cfg.eval_every == 0 or self.step == self.total_steps
            )
            if evaluated:
                self._evaluate()
            if self.mode == "overfit" and step_loss < modes.OVERFIT_LOSS:
                break
            new_best = evaluated and self._best_step() == self.step
            if (
                self.step % cfg.checkpoint_every == 0
                or self.step == self.total_steps
                or (new_best and cfg.select == "best_val_loss")  # the adapter it may publish
            ):
                self.save_checkpoint()
            if evaluated and self._early_stop():
                break
            capped = self.mode == "train" and self.meter.caps.any  # rank 0's clock decides
            over = rank0_decides(self.meter.check(), world) if capped else []
            if self.stop_signal is not None or (over and self.step < self.total_steps):
                if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(
                    f"{self.step:08d}"
                ):
                    self.save_checkpoint()
                if self.stop_signal is None:
                    raise publishing.cap_reached(self, over)
                name = signal.Signals(self.stop_signal).name
                raise TrainingInterrupted(
                    f"{name} received: stopped after step {self.step}; checkpoint {self.last_checkpoint}",
                    "continue with the same command plus --resume",
                )

    def _best_step(self) -> int | None:
        return standing(self.val_losses).best_step

    def _early_stop(self) -> bool:
        stop = self.config.early_stopping
        if stop is None or not should_stop(self.val_losses, stop.patience, stop.min_delta):
            return False
        best = standing(self.val_losses)
        self.say(
            f"early stopping at step {self.step}: {stop.patience} evaluation(s) in a row "
            f"without a fall of more than {stop.min_delta} in validation loss (best "
            f"{best.best_loss:.4f} at step {best.best_step})"
        )
        return True

    def _evaluate(self) -> float:
        self.model.eval()
        total, count = 0.0, 0
        mb = self.config.micro_batch
        with torch.no_grad():
            for i in range(0, len(self.val_samples), mb):
                chunk = self.val_samples[i : i + mb]
                batch = {k: v.to(self.device) for k, v in collate(chunk, self.pad).items()}
                total += batch_loss(self.model, batch).item()
                count += supervised_count(chunk)
        self.model.train()
        val = total / max(1, count)
        self.val_losses[self.step] = val
        if self.settings.is_main:
            write_json(
                self.metrics_dir / f"eval-step-{self.step}.json",
                {"step": self.step, "val_loss": val},
            )
        self.live.evaluated(self.step, val)
        line = f"eval step {self.step}: validation loss {val:.4f} ({count} supervised tokens)"
        self.say(line)
        return val

    # ---- checkpoints --------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        if not self.settings.is_main:
            return None
        state = {
            "epoch": (self.step - 1) // max(1, self.plan.steps_per_epoch()),
            "tokens_seen": self.tokens_seen,
            "supervised_seen": self.supervised_seen,
            "wall_s": self.wall_before + self.meter.seconds(),
            "val_losses": {str(k): v for k, v in self.val_losses.items()},
        }
        folder = checkpoint.save(
            self.ckpt_root,
            self.step,
            self.peft,
            self.optimizer,
            self.scheduler,
            state,
            self.run_manifest,
        )
        self.last_checkpoint = folder
        self.say(f"checkpoint step {self.step}: {folder}")
        if self.mode == "train":
            publishing.publish_checkpoint(self, folder)
        keep = publishing.kept_best(self)
        for old in checkpoint.local_steps(self.ckpt_root)[: -self.config.keep_checkpoints]:
            if old != keep:
                shutil.rmtree(checkpoint.step_dir(self.ckpt_root, old), ignore_errors=True)
        return folder

    # ---- finish -------------------------------------------------------------------

    def finish(self) -> TrainResult:
        cfg = self.config
        self._lap("steps")
        done = publishing.already_finished(self)
        if done is not None:
            return done
        if self.val_samples and self.step not in self.val_losses and self.step > 0:
            self._evaluate()
        if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(
            f"{self.step:08d}"
        ):
            self.save_checkpoint()
        train_series = read_series(self.metrics_dir, "metrics", "loss")
        plot = self.run_dir / "loss.png"
        if self.settings.is_main:
            plot_losses(train_series, self.val_losses, plot, f"{cfg.output} ({self.mode})")
        wall = self.wall_before + self.meter.seconds()
        billed_h = wall / 3600 * self.settings.world_size
        peak = peak_bytes(self.device)
        measured = memory_now(self.device)
        completion = {
            "mode": self.mode,
            "wall_s": round(wall, 3),
            "steps": self.step,
            "tokens": self.tokens_seen,
            "supervised_tokens": self.supervised_seen,
            # over the whole wall time, set-up included: what the bill pays for
            "tokens_per_s": round(self.tokens_seen / wall, 1) if wall > 0 else None,
            "supervised_tokens_per_s": round(self.supervised_seen / wall, 1) if wall > 0 else None,
            "peak_memory": peak,
            "peak_reserved": measured.get("peak_reserved"),
            "memory_estimate": self.memory_estimate.get("total", 0),
            "final_val_loss": self.val_losses.get(self.step),
            "best_val_loss": min(self.val_losses.values()) if self.val_losses else None,
            "final_train_loss": self.losses.get(self.step),
            "trainable_params": self.trainable,
            "billed_hours": billed_h,
            "price_per_gpu_hour": cfg.price_per_gpu_hour,
            "cost": round(billed_h * cfg.price_per_gpu_hour, 6),
            "device": device_facts(self.device),
            "nvml": nvml_reading(self.device) or None,  # the nvidia-smi reading at the end
            "compile": compile_report() if self.compiler.active else None,
        }
        self.say(
            f"memory: estimated {human(self.memory_estimate.get('total', 0))}, measured peak "
            f"{human(peak)} ({'torch allocated' if self.device.type == 'cuda' else 'process RSS'})",
        )
        result = self._result(completion)
        if self.mode == "smoke":
            result.verdict = modes.smoke_verdict(self, train_series)
        elif self.mode == "overfit":
            result.verdict = modes.overfit_verdict(self)
        if self.mode == "train" and self.settings.is_main:
            completion["selected"] = publishing.select_adapter(self)
            result.adapter = publishing.publish_adapter(self, completion, plot)
            completion["adapter_digest"] = result.adapter.digest
        self._lap("finish")
        completion["phases_s"] = self.phases
        self.say("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()))
        if self.settings.is_main:
            write_json(self.run_dir / "training-complete.json", completion)
        if result.verdict is not None:
            self.say(("PASS" if result.verdict["passed"] else "FAIL") + f" ({self.mode})")
            for c in result.verdict["checks"]:
                self.say(f"  {c}")
        return result

    def _result(self, completion: dict[str, Any]) -> TrainResult:
        return TrainResult(
            self.mode,
            self.run_dir,
            self.step,
            dict(self.losses),
            dict(self.val_losses),
            data=self.data_manifest,
            test=self.test_manifest,
            completion=completion,
            preflight=self.report,
        )

    def cleanup(self) -> None:
        self.live.close(linger_s=self.settings.metrics_linger_s)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self.settings.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


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
        error, memo = progress.failed(recipe, e)
        try:
            hooks.after_failure(recipe, error, memo, dict(os.environ))
        except Exception as h:  # never hide the run's own error behind the hook's
            recipe.say(f"on_failure hook not run: {type(h).__name__}: {h}")
        if error is e:
            raise
        raise error from e
    finally:
        recipe.cleanup()
        logging.getLogger().removeHandler(tail)
    if result.verdict is not None and not result.verdict["passed"]:
        raise SmokeFailed(
            f"{mode} run failed:\n" + "\n".join(f"  {c}" for c in result.verdict["checks"]),
            "see the failing checks above; 'lorastack data inspect' shows what is supervised",
        )
    result.hook = hooks.after_success(recipe, result, dict(os.environ))
    return result
