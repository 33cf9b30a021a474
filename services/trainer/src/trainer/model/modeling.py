"""The only module that builds models and computes the loss.

`load_model` is the one place a base model is loaded (fp32 on CPU, bf16 on CUDA;
nf4 + double quant for QLoRA, same code path) and wrapped with LoRA. `loss_sum` is the
one place the loss is computed. Both are the fast path, on CPU and CUDA alike
(bench/trainer/trainer_gpu.py measures it against the plain transformers+peft recipe,
bench/trainer/gpu_e2e.py the whole `lorastack train` against TRL):

- no `prepare_model_for_kbit_training`: it upcasts every non-quantized weight
  (embeddings, norms, a 128k-vocabulary lm_head) to fp32, which costs memory and runs
  the output projection in fp32; the frozen weights stay in the compute dtype;
- LoRA weights stay fp32 (the optimizer's master copy) but compute in the compute dtype
  under autocast, instead of peft casting every adapter input up to fp32 (on CUDA that
  cast doubled the saved activations);
- each LoRA linear is one autograd node (trainer.model.fast_lora): at batch 1 on a GPU the
  step was bound by peft's and bitsandbytes' per-op Python, not by the GPU;
- gradient checkpointing is non-reentrant, per decoder layer;
- the cross-entropy never materialises the full logits (trainer.model.cross_entropy): only
  supervised positions go through lm_head, in recomputed chunks.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from lorastack.errors import ConfigError
from trainer.config import RunConfig
from trainer.model import attention, fast_lora
from trainer.model.cross_entropy import linear_cross_entropy_sum


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """The device for `choice` (cuda | cpu | auto); ConfigError if cuda is asked but absent."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device", "set device=cpu or auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def use_expandable_segments(device: torch.device, alloc_conf: str | None) -> None:
    """Let CUDA's caching allocator grow segments instead of keeping a block per size:
    the loss chunks and packed rows change size every step, and with fixed segments the
    allocator reserved several times the peak of allocations (bench/trainer/README.md).
    Left alone when the user
    configures the allocator (PYTORCH_CUDA_ALLOC_CONF, passed as `alloc_conf`)."""
    if device.type == "cuda" and not alloc_conf:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the run computes in: bf16 on CUDA, fp32 on CPU."""
    # bf16 on CUDA; fp32 on CPU (a bf16 forward was 5x slower on AVX2 without AVX-512 bf16)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def module_names(base_dir: Path) -> set[str]:
    """Names of the weight-bearing modules (e.g. q_proj), read from the safetensors
    headers without loading any tensor."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                parts = key.split(".")
                if len(parts) >= 2 and parts[-1] == "weight":
                    names.add(parts[-2])
    return names


def check_target_modules(base_dir: Path, targets: list[str]) -> None:
    """Raise ConfigError naming the LoRA targets that are not modules of the base."""
    names = module_names(base_dir)
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted(n for n in names if n.endswith("_proj") or n in ("lm_head", "fc1", "fc2"))
        raise ConfigError(
            f"lora.target_modules {missing} are not modules of the base model",
            f"choose among {linear}",
        )


def read_model_config(base_dir: Path) -> dict[str, Any]:
    """The base model's config.json, parsed."""
    cfg: dict[str, Any] = json.loads((base_dir / "config.json").read_text())
    return cfg


def base_load_kwargs(
    config: RunConfig, device: torch.device, quantization: str | None = None
) -> dict[str, Any]:
    """`from_pretrained` keywords that load the base as training runs it: the compute
    dtype, and nf4 with double quantisation for QLoRA (`quantization` overrides the
    run's: "none" loads a QLoRA run's base unquantised, as it is served)."""
    from transformers import BitsAndBytesConfig

    dtype = compute_dtype(device)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if (quantization or config.quantization) == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    return kwargs


def load_model(
    base_dir: Path,
    config: RunConfig,
    device: torch.device,
    on_host: bool = False,
    checkpointed: int | None = None,
) -> Any:
    """The base model from `base_dir` with fresh LoRA adapters (seeded by config.seed), in
    `device`'s compute dtype; left in host memory with `on_host` (FSDP moves its shards).
    `checkpointed`: how many decoder layers (the first ones) recompute their activations
    in backward; unset: every layer with gradient_checkpointing true, else none (the
    recipe plans auto: trainer.assembly.estimate_memory)."""
    from peft import LoraConfig, get_peft_model

    dtype = compute_dtype(device)
    model = _load_base(base_dir, config, device)
    model.config.use_cache = False
    if config.quantization != "nf4" and not on_host:
        model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)  # only the LoRA weights train
    checkpointed = _checkpoint_layers(model, config, checkpointed)
    torch.manual_seed(config.seed)  # LoRA A init
    lora = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=list(config.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    if dtype != torch.float32:
        # fp32 LoRA weights, low-precision compute: autocast in loss_sum does the casts
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in peft_model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False  # type: ignore[assignment]
    if config.fused_lora:
        fast_lora.install(peft_model)
    if checkpointed:
        drop_input_require_grads(peft_model.get_base_model())
    return peft_model


def _load_base(base_dir: Path, config: RunConfig, device: torch.device) -> Any:
    """The base model from `base_dir`, with the varlen attention where the run packs rows
    and the architecture takes it."""
    from transformers import AutoModelForCausalLM

    kwargs = base_load_kwargs(config, device)
    model: Any = None
    if attention.use_varlen(config, device, read_model_config(base_dir)):
        attention.register()
        # an architecture without transformers' attention interface refuses the name at
        # the class check, before any weight loads: it loads with the default below
        with contextlib.suppress(ValueError):
            model = AutoModelForCausalLM.from_pretrained(
                base_dir, attn_implementation=attention.VARLEN, **kwargs
            )
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(base_dir, **kwargs)
    return model


def _checkpoint_layers(model: Any, config: RunConfig, checkpointed: int | None) -> int:
    """Turn activation checkpointing on for the first `checkpointed` decoder layers (unset:
    all of them with gradient_checkpointing true, else none); returns how many."""
    if checkpointed is None:
        checkpointed = (
            len(model.get_decoder().layers) if config.gradient_checkpointing is True else 0
        )
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(model.get_decoder().layers):
            layer.gradient_checkpointing = i < checkpointed
    return checkpointed


def drop_input_require_grads(model: Any) -> None:
    """Remove the forward hooks that set requires_grad on the embeddings' output.

    peft adds one with checkpointing on (more than once: transformers' own
    `disable_input_require_grads` then forgets the first); only reentrant checkpointing
    needs it, and under torch.compile its `requires_grad_()` breaks the decoder's graph
    in two (services/trainer/tests/test_trainer_compile.py counts them)."""
    hooks = model.get_input_embeddings()._forward_hooks
    for key, hook in list(hooks.items()):
        if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
            del hooks[key]


def loss_sum(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    loss_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of the next-token cross-entropy over supervised positions (fp32).

    `labels` is aligned with `input_ids` (IGNORE where not supervised); position t's
    hidden state predicts token t+1. Divide by the step's supervised-token count outside.
    Packed rows (trainer.data.packing) come with `position_ids`, `cu_seq_lens` and no
    `attention_mask`. `loss_positions` (cross_entropy.loss_positions, computed on the
    host) spares the device a boolean mask and its host syncs.
    """
    base = model.get_base_model()
    head = base.get_output_embeddings().weight
    low = head.dtype != torch.float32  # bf16 compute on CUDA, fp32 on CPU
    extra = attention.model_kwargs(base, cu_seq_lens, input_ids.shape[1])
    with torch.autocast(input_ids.device.type, dtype=head.dtype, enabled=low):
        extra.setdefault("attention_mask", attention_mask)
        out = base.get_decoder()(input_ids=input_ids, position_ids=position_ids, **extra)
        return linear_cross_entropy_sum(
            out.last_hidden_state, head, labels, positions=loss_positions
        )


def batch_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """loss_sum of a collated batch (trainer.data.batching: padded rows or packed rows)."""
    return loss_sum(
        model,
        batch["input_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        batch.get("position_ids"),
        batch.get("cu_seq_lens"),
    )


class LossModule(torch.nn.Module):
    """The model and its loss as one module: under DistributedDataParallel the forward
    must go through the wrapper (its gradient hooks and buffers), and loss_sum reaches
    into the PEFT model's decoder and head, which the wrapper does not expose."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The summed loss of the batch: loss_sum's arguments after the model, on the
        wrapped model."""
        return loss_sum(self.model, *args, **kwargs)
