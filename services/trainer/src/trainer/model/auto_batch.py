"""`--auto-batch`: the largest micro-batch that fits, keeping the effective batch.

`choose` is the search, a pure function of the effective batch (micro_batch x grad_accum)
and a `fits(micro_batch)` predicate: powers of two that divide the effective batch, up to
the first that does not fit. `probe` is the predicate on a GPU: one forward and backward
of the widest rows the run will see. The effective batch, the learning rate's meaning,
never changes; only how it is split into micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import RunConfig, with_overrides
from trainer.errors import TrainingOOM
from trainer.model.modeling import load_model, loss_sum
from trainer.support_bundle import OOM_HINT

if TYPE_CHECKING:
    from pathlib import Path

    from trainer.settings import TrainerSettings


def choose(effective: int, fits: Callable[[int], bool], seq: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) with micro_batch x grad_accum == effective."""
    best, mb = 0, 1
    while mb <= effective:
        if effective % mb == 0:
            if not fits(mb):
                break
            best = mb
        mb *= 2
    if best == 0:
        raise TrainingOOM(f"auto-batch: even micro_batch=1 at {seq} tokens does not fit", OOM_HINT)
    return best, effective // best


def probe(model: Any, seq: int, token: int, device: torch.device) -> Callable[[int], bool]:
    """fits(micro_batch) on `device`: one forward and backward of `seq`-token rows."""

    def fits(mb: int) -> bool:
        try:
            ids = torch.full((mb, seq), token, dtype=torch.long, device=device)
            loss_sum(model, ids, torch.ones_like(ids), ids).backward()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return fits


def fit_micro_batch(
    cfg: RunConfig,
    settings: TrainerSettings,
    base_dir: Path,
    model_config: dict[str, Any],
    device: torch.device,
    *,
    eot: int,
    seq: int,
    say: Callable[[str], None],
) -> RunConfig:
    """The run's config with the micro-batch the GPU fits (CUDA only; else unchanged):
    probed with rows of `seq` tokens (the widest micro-batch's) of the token `eot`."""
    effective = cfg.micro_batch * cfg.grad_accum
    keeping = f"keeping micro_batch={cfg.micro_batch}, grad_accum={cfg.grad_accum}"
    if device.type != "cuda":
        say(f"auto-batch: probing needs a CUDA device; {keeping}")
        return cfg
    if cfg.distributed == "fsdp" and settings.world_size > 1:
        say(f"auto-batch: the probe loads the whole model on one GPU, not under FSDP; {keeping}")
        return cfg
    # gradient_checkpointing auto probes with every layer recomputed (the least memory);
    # the plan then recomputes as few as the chosen micro-batch allows
    every = int(model_config["num_hidden_layers"])
    model = load_model(
        base_dir, cfg, device, checkpointed=every if cfg.gradient_checkpointing else 0
    )
    try:
        best, accum = choose(effective, probe(model, seq, eot, device), seq)
    finally:
        del model
        torch.cuda.empty_cache()
    say(f"auto-batch: micro_batch={best}, grad_accum={accum} (effective {effective})")
    return with_overrides(cfg, [f"micro_batch={best}", f"grad_accum={accum}"])
