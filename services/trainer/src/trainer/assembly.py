"""What the recipe's setup assembles once the data is prepared: the run manifest (what
--resume compares), the data and test splits published, the memory estimate, the model
with its loss module, optimizer and schedule (seeded, maybe compiled, DDP-wrapped or
FSDP-sharded on several processes), and the live metrics. Each takes the plan as setup
has decided it so far (trainer.state.RunPlan) and returns what it makes. Preparing the
data is trainer.data.preparation; the order of the steps, and the resume in between,
stay in trainer.recipe.Recipe.setup.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from lorastack.manifest import Manifest, git_commit
from trainer.config import RunConfig
from trainer.data.batching import lr_factor
from trainer.data.preparation import Prepared
from trainer.data.samples import template_hash
from trainer.data.splits import publish_once
from trainer.loop.live import LiveRun
from trainer.model.compiling import CompileRun
from trainer.model.distributed import wrap_for_processes
from trainer.model.memory import PLAN_HEADROOM, estimate, human, plan_checkpointing
from trainer.model.modeling import LossModule, compute_dtype, load_model
from trainer.publish import checkpoint
from trainer.readings import library_versions
from trainer.records import write_json
from trainer.settings import TrainerSettings
from trainer.state import Components, RunPlan

if TYPE_CHECKING:
    from trainer.model.ahead import Ahead


class PublishedSplits(NamedTuple):
    """The manifests of `<output>/data` and of its frozen `<output>/test`."""

    data: Manifest
    test: Manifest


class MemoryPlan(NamedTuple):
    """The memory estimate and the activation recomputation it planned."""

    estimate: dict[str, int]  # bytes per part (trainer.model.memory.estimate)
    checkpointed: int  # decoder layers that recompute their activations in backward


class BuiltModel(NamedTuple):
    """What build_model makes: the components and the compile note for the start line."""

    components: Components
    compile_note: str  # what the "training ..." start line says of compiling (may be "")


def run_manifest(
    cfg: RunConfig, settings: TrainerSettings, device: torch.device, prep: Prepared
) -> dict[str, Any]:
    """What makes the run the run: data, base, config, code, libraries, template, device."""
    return {
        "dataset_digest": prep.data_digest,
        "test_digest": prep.test_digest,
        "base": {"ref": prep.base.ref, "digest": prep.base.digest},
        "config_hash": cfg.config_hash(),
        "config": cfg.model_dump(mode="json"),
        "code_version": checkpoint.code_version(),
        "git_commit": git_commit(),
        "libraries": library_versions(),
        "template_hash": template_hash(prep.tokenizer),
        "device_type": device.type,
        "world_size": settings.world_size,
    }


def publish_splits(cfg: RunConfig, prep: Prepared) -> PublishedSplits:
    """`<output>/data` and its frozen `<output>/test`, each published once."""
    data = publish_once(
        prep.store,
        prep.data_dir,
        f"{cfg.output}/data",
        {"split": prep.splits.counts(), "source": prep.splits.source},
    )
    test = publish_once(
        prep.store,
        prep.test_dir,
        f"{cfg.output}/test",
        {"frozen_test_of": f"{cfg.output}/data"},
    )
    return PublishedSplits(data, test)


def estimate_memory(
    cfg: RunConfig,
    settings: TrainerSettings,
    device: torch.device,
    model_config: dict[str, Any],
    *,
    seq_len: int,
    run_dir: Path,
    say: Callable[[str], None],
) -> MemoryPlan:
    """The memory estimate (trainer.model.memory), written as memory-estimate.json and said,
    and how many decoder layers recompute their activations (gradient_checkpointing).
    `seq_len`: tokens in a row of the widest micro-batch (trainer.data.batching)."""
    args: dict[str, Any] = {
        "r": cfg.lora.r,
        "targets": cfg.lora.target_modules,
        "quantization": cfg.quantization,
        "compute_bytes": 2 if compute_dtype(device) == torch.bfloat16 else 4,
        "micro_batch": cfg.micro_batch,
        "seq_len": seq_len,
        "cuda": device.type == "cuda",
        "lora_dropout": cfg.lora.dropout,
        "shards": settings.world_size if cfg.distributed == "fsdp" else 1,
    }
    layers = int(model_config["num_hidden_layers"])
    if cfg.gradient_checkpointing != "auto":
        checkpointed = layers if cfg.gradient_checkpointing else 0
    elif device.type != "cuda":
        checkpointed = 0
    else:
        budget = int(torch.cuda.mem_get_info(device)[0] * PLAN_HEADROOM)
        checkpointed = plan_checkpointing(model_config, budget, **args)
        say(
            f"gradient checkpointing auto: {checkpointed} of {layers} layers recomputed "
            f"in backward (the estimate fits {human(budget)}, {PLAN_HEADROOM:.0%} of the "
            "GPU's free memory)"
        )
    found = estimate(model_config, checkpointed=checkpointed, **args)
    write_json(run_dir / "memory-estimate.json", found)
    say("memory estimate: " + ", ".join(f"{k} {human(v)}" for k, v in found.items() if v))
    return MemoryPlan(found, checkpointed)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's random generators with `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(
    cfg: RunConfig, params: list[torch.nn.Parameter], total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its learning-rate schedule (warm-up, then cfg.schedule over
    `total_steps`)."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup, schedule = cfg.warmup_steps, cfg.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, schedule)
    )
    return optimizer, scheduler


def build_model(
    cfg: RunConfig,
    settings: TrainerSettings,
    base_dir: Path,
    model_config: dict[str, Any],
    device: torch.device,
    *,
    checkpointed: int,
    ahead: Ahead | None,
    mode: str,
    total_steps: int,
    lap: Callable[[str], None],
) -> BuiltModel:
    """Seed, load the model (maybe compiled), wrap its loss for training (DDP or FSDP on
    several processes), and make the optimizer and schedule; returns them with the compile
    note for the start line. `lap` times the load (with the compile's start)."""
    seed_everything(cfg.seed)
    sharded = cfg.distributed == "fsdp" and settings.world_size > 1
    # left on the host under FSDP: fully_shard moves it
    peft = load_model(base_dir, cfg, device, on_host=sharded, checkpointed=checkpointed)
    compiler = CompileRun(
        cfg,
        device,
        model_config,
        settings.resolved_cache_dir / "torch-compile",
        ahead,
        all_checkpointed=checkpointed == int(model_config["num_hidden_layers"]),
    )
    compiling = compiler.begin(peft)
    lap("load_model")
    # training calls the loss through one module; DDP wraps (FSDP shards) it on several
    # processes
    train_loss: Any = LossModule(peft)
    if settings.world_size > 1:
        train_loss = wrap_for_processes(train_loss, cfg, settings.world_size, device, mode)
    peft.train()
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(cfg, params, total_steps)
    components = Components(
        peft=peft,
        compiler=compiler,
        train_loss=train_loss,
        trainable=sum(p.numel() for p in params),
        optimizer=optimizer,
        scheduler=scheduler,
    )
    return BuiltModel(components, compiling)


def live_run(plan: RunPlan, resumed_at: int | None) -> LiveRun:
    """The live metrics (and progress bar, TensorBoard) of rank 0; a quiet one elsewhere."""
    cfg, settings = plan.config, plan.settings
    return LiveRun(
        cfg.output,
        plan.total_steps,
        settings.metrics_port if settings.is_main else None,
        settings.metrics_host,
        bar=None if settings.is_main else False,
        tensorboard=plan.run_dir / "tensorboard"
        if "tensorboard" in cfg.report_to and settings.is_main
        else None,
        resumed_at=resumed_at,
    )
