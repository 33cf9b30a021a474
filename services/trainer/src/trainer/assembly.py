"""What the recipe's setup assembles once the data is prepared: the run manifest (what
--resume compares), the data and test splits published, the memory estimate, the model
with its loss module, optimizer and schedule (seeded, maybe compiled, DDP-wrapped or
FSDP-sharded on several processes), and the live metrics. Preparing the data is
trainer.data.preparation; the order of the steps, and the resume in between, stay in
trainer.recipe.Recipe.setup.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lorastack.manifest import Manifest, git_commit
from trainer.config import RunConfig
from trainer.data.batching import lr_factor
from trainer.data.samples import template_hash
from trainer.data.splits import publish_once
from trainer.loop.live import LiveRun
from trainer.metrics import library_versions, write_json
from trainer.model.compiling import CompileRun
from trainer.model.distributed import wrap_for_processes
from trainer.model.memory import PLAN_HEADROOM, estimate, human, plan_checkpointing
from trainer.model.modeling import LossModule, compute_dtype, load_model
from trainer.publish import checkpoint
from trainer.settings import TrainerSettings
from trainer.state import Components

if TYPE_CHECKING:
    from trainer.model.ahead import Ahead
    from trainer.recipe import Recipe


def run_manifest(r: Recipe) -> dict[str, Any]:
    """What makes the run the run: data, base, config, code, libraries, template, device."""
    return {
        "dataset_digest": r.prep.data_digest,
        "test_digest": r.prep.test_digest,
        "base": {"ref": r.prep.base.ref, "digest": r.prep.base.digest},
        "config_hash": r.config.config_hash(),
        "config": r.config.model_dump(mode="json"),
        "code_version": checkpoint.code_version(),
        "git_commit": git_commit(),
        "libraries": library_versions(),
        "template_hash": template_hash(r.prep.tokenizer),
        "device_type": r.device.type,
        "world_size": r.settings.world_size,
    }


def publish_splits(r: Recipe) -> tuple[Manifest, Manifest]:
    """`<output>/data` and its frozen `<output>/test`, each published once."""
    cfg = r.config
    data = publish_once(
        r.prep.store,
        r.prep.data_dir,
        f"{cfg.output}/data",
        {"split": r.prep.splits.counts(), "source": r.prep.splits.source},
    )
    test = publish_once(
        r.prep.store,
        r.prep.test_dir,
        f"{cfg.output}/test",
        {"frozen_test_of": f"{cfg.output}/data"},
    )
    return data, test


def estimate_memory(r: Recipe) -> dict[str, int]:
    """The memory estimate (trainer.model.memory), written as memory-estimate.json and said;
    sets how many decoder layers recompute their activations (gradient_checkpointing)."""
    cfg = r.config
    args: dict[str, Any] = {
        "r": cfg.lora.r,
        "targets": cfg.lora.target_modules,
        "quantization": cfg.quantization,
        "compute_bytes": 2 if compute_dtype(r.device) == torch.bfloat16 else 4,
        "micro_batch": cfg.micro_batch,
        "seq_len": r.widest(),
        "cuda": r.device.type == "cuda",
        "lora_dropout": cfg.lora.dropout,
        "shards": r.settings.world_size if cfg.distributed == "fsdp" else 1,
    }
    layers = int(r.model_config["num_hidden_layers"])
    if cfg.gradient_checkpointing != "auto":
        r.checkpointed = layers if cfg.gradient_checkpointing else 0
    elif r.device.type != "cuda":
        r.checkpointed = 0
    else:
        budget = int(torch.cuda.mem_get_info(r.device)[0] * PLAN_HEADROOM)
        r.checkpointed = plan_checkpointing(r.model_config, budget, **args)
        r.say(
            f"gradient checkpointing auto: {r.checkpointed} of {layers} layers recomputed "
            f"in backward (the estimate fits {human(budget)}, {PLAN_HEADROOM:.0%} of the "
            "GPU's free memory)"
        )
    found = estimate(r.model_config, checkpointed=r.checkpointed, **args)
    write_json(r.run_dir / "memory-estimate.json", found)
    r.say("memory estimate: " + ", ".join(f"{k} {human(v)}" for k, v in found.items() if v))
    return found


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
) -> tuple[Components, str]:
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
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup, schedule = cfg.warmup_steps, cfg.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, schedule)
    )
    parts = Components(
        peft=peft,
        compiler=compiler,
        train_loss=train_loss,
        trainable=sum(p.numel() for p in params),
        optimizer=optimizer,
        scheduler=scheduler,
    )
    return parts, compiling


def live_run(r: Recipe) -> LiveRun:
    """The live metrics (and progress bar, TensorBoard) of rank 0; a quiet one elsewhere."""
    cfg, settings = r.config, r.settings
    return LiveRun(
        cfg.output,
        r.total_steps,
        settings.metrics_port if settings.is_main else None,
        settings.metrics_host,
        bar=None if settings.is_main else False,
        tensorboard=r.run_dir / "tensorboard"
        if "tensorboard" in cfg.report_to and settings.is_main
        else None,
        resumed_at=r.progress.resumed_at,
    )
