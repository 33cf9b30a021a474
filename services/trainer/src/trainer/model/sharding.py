"""`distributed: fsdp` under torchrun: FSDP2 (torch.distributed.fsdp.fully_shard) shards
each decoder layer, then the loss module around the whole model (the root: embeddings,
final norm, lm_head), over the processes; a model that does not fit one GPU trains with
each GPU holding 1/N of its weights plus one layer's whole weights at a time.

- Each process loads the base into host memory, and fully_shard moves its shard to the
  GPU layer by layer (no GPU ever holds the whole model).
- On CUDA the weights are gathered in bf16 and the gradients reduced in fp32 (the LoRA
  weights and AdamW state stay fp32, sharded); on the CPU everything is fp32.
- Every forward goes through the root (training and validation alike): outside it the
  root's own weights are shards.
- Checkpoints: the LoRA weights and the AdamW state are gathered whole (collective, every
  process calls `gather`), rank 0 writes them as a normal PEFT adapter and an optimizer
  state keyed by parameter name; a resume loads them whole on every process and shards
  them again (`load`), bit for bit.
- Not here: QLoRA (refused by the config: bitsandbytes needs bnb_4bit_quant_storage for
  sharded 4-bit weights, untested), torch.compile (compile: auto stays eager, true is
  refused), smoke and overfit runs (one-process checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from lorastack.errors import ConfigError

ROOT_PREFIX = "model."  # LossModule.model: the PEFT model under the root


@dataclass
class Gathered:
    """Whole LoRA weights (PEFT's names, adapter name included) and AdamW state (by
    parameter name) on rank 0; empty elsewhere."""

    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def is_sharded(module: Any) -> bool:
    """Whether `module` is sharded by FSDP."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a PEFT causal LM: the units fully_shard shards one by one."""
    layers = getattr(model.get_base_model().get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(
            f"distributed: fsdp finds no decoder layers in {type(model.get_base_model()).__name__}",
            "set distributed: ddp for this model",
        )
    return list(layers)


def shard(root: torch.nn.Module, model: Any, device: torch.device, mode: str) -> Any:
    """fully_shard every decoder layer of `model`, then `root` (the loss module holding it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mode != "train":
        raise ConfigError(
            f"distributed: fsdp does not run {mode} runs over several processes",
            f"run the {mode} run as one process (without torchrun), or set distributed: ddp",
        )
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()  # fp32: the CPU computes in fp32
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root


def _options(*, offload: bool = False, strict: bool = True) -> Any:
    """Whole state dicts (not shards); `offload`: on rank 0's CPU only, only the trainable."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=True, cpu_offload=offload, ignore_frozen_params=offload, strict=strict
    )


def gather(root: Any, optimizer: torch.optim.Optimizer) -> Gathered | None:
    """The whole LoRA weights and AdamW state on rank 0 (None unless `root` is sharded).
    Every process must call it: the shards are gathered."""
    if not is_sharded(root):
        return None
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = _options(offload=True)
    weights = get_model_state_dict(root, options=opts)
    optim = get_optimizer_state_dict(root, optimizer, options=opts)
    adapter = {k.removeprefix(ROOT_PREFIX): cast(torch.Tensor, v) for k, v in weights.items()}
    return Gathered(adapter, dict(optim))


def load(
    root: Any,
    model: Any,
    optimizer: torch.optim.Optimizer,
    adapter: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
    source: str,
) -> None:
    """Shard a saved PEFT adapter (`adapter`, PEFT's saved names) and the whole AdamW state
    into the sharded `root`. Every process loads the whole of both."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    tag = f".{model.active_adapter}"  # PEFT saves the names without the adapter's
    names = {
        n.removeprefix(ROOT_PREFIX).replace(tag, ""): n
        for n, p in root.named_parameters()
        if p.requires_grad
    }
    if set(adapter) != set(names):
        odd = sorted(set(adapter) ^ set(names))
        raise RuntimeError(
            f"checkpoint {source} does not match the model's LoRA weights: {odd[:3]}"
        )
    set_model_state_dict(
        root, {names[k]: v for k, v in adapter.items()}, options=_options(strict=False)
    )
    set_optimizer_state_dict(root, optimizer, optim_state, options=_options())
