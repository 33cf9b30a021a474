"""Several processes under torchrun: DistributedDataParallel (or FSDP2, `distributed: fsdp`,
trainer.model.sharding) around the loss, gradient sync on a step's last micro-batch only, each
process's share of a step's micro-batches, the few values the processes agree on, and the
process group's end.

The global batch is micro_batch x grad_accum whatever the number of processes: each of N
takes grad_accum / N micro-batches of every step. Gradients are averaged by DDP (FSDP's
reduce-scatter too), so the recipe scales each process's loss by N to keep their sum.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar, cast

import torch

from trainer.config import RunConfig, check_processes
from trainer.settings import TrainerSettings

T = TypeVar("T")


def wrap_for_processes(
    module: Any, cfg: RunConfig, world: int, device: torch.device, mode: str
) -> Any:
    """`module` (the loss module) in DistributedDataParallel, or sharded (distributed: fsdp)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    check_processes(cfg, world)
    if device.type == "cuda":  # the object collectives (rank0_decides) use this GPU
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.distributed == "fsdp":
        from trainer.model.sharding import shard

        return shard(module, module.model, device, mode)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def restart_hazard(settings: TrainerSettings) -> str | None:
    """What to change when torchrun would restart the group on a store that keeps the
    last attempt's keys: with its agent's shared store (torch >= 2.5) a restarted process
    can read the peer addresses of the attempt before and fail or hang in
    init_process_group (pytorch/pytorch#135712; here: 1 of 9 two-node restarts on a
    loaded CPU hung). None when there is no restart or each attempt gets a new store."""
    restarts = settings.world_size > 1 and settings.elastic_restarts > 0
    if not (restarts and settings.elastic_agent_store):
        return None
    return (
        f"warning: torchrun restarts this group up to {settings.elastic_restarts} times "
        "through its shared rendezvous store, where a restarted process can read the "
        "addresses of the attempt before and hang (pytorch/pytorch#135712); start torchrun "
        "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (the multi-node "
        "overlay sets it)"
    )


def syncing(module: Any, last: bool) -> contextlib.AbstractContextManager[None]:
    """Gradient sync over the processes only on a step's last micro-batch: DDP's no_sync
    before it, FSDP's reduce-scatter only after it."""
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(last)
    elif not last and hasattr(module, "no_sync"):  # DDP
        return cast(contextlib.AbstractContextManager[None], module.no_sync())
    return contextlib.nullcontext()


def shut_down(world: int) -> None:
    """End the process group at the end of a run of several processes."""
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def my_share(batches: list[T], rank: int, world: int) -> list[tuple[T, float]]:
    """This process's micro-batches of a step, each with its weight. Every process runs as
    many (the last step of an epoch can hold fewer than grad_accum): a missing one is a
    repeat of weight 0, so that each process's gradient all-reduce meets the others'."""
    share = -(-len(batches) // world)
    return [
        (batches[i], 1.0) if i < len(batches) else (batches[0], 0.0)
        for i in range(rank, share * world, world)
    ]


def sum_over_ranks(value: float, device: torch.device) -> float:
    """`value` summed over every process (an all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def rank0_decides(choice: Any, world: int) -> Any:
    """Rank 0's value of `choice` on every process."""
    if world == 1:
        return choice
    import torch.distributed as dist

    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return box[0]
