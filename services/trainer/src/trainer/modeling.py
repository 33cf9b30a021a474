"""The only module that builds models and computes the loss.

`load_model` is the one place a base model is loaded (fp32 on CPU, bf16 on CUDA;
nf4 + double quant for QLoRA, same code path) and wrapped with LoRA. `loss_sum` is the
one place the loss is computed: a later GPU task swaps in a chunked/fused
cross-entropy there without touching the recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lorastack.errors import ConfigError
from trainer.config import RunConfig
from trainer.masking import IGNORE


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device", "set device=cpu or auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def compute_dtype(device: torch.device) -> torch.dtype:
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
    names = module_names(base_dir)
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted(n for n in names if n.endswith("_proj") or n in ("lm_head", "fc1", "fc2"))
        raise ConfigError(
            f"lora.target_modules {missing} are not modules of the base model",
            f"choose among {linear}",
        )


def read_model_config(base_dir: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((base_dir / "config.json").read_text())
    return cfg


def load_model(base_dir: Path, config: RunConfig, device: torch.device) -> Any:
    """The base model from `base_dir` with fresh LoRA adapters (seeded by config.seed)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = compute_dtype(device)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if config.quantization == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else "cpu"}
    model: Any = AutoModelForCausalLM.from_pretrained(base_dir, **kwargs)
    model.config.use_cache = False
    if config.quantization == "nf4":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=config.gradient_checkpointing
        )
    else:
        model.to(device)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.enable_input_require_grads()
    torch.manual_seed(config.seed)  # LoRA A init
    lora = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=list(config.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def loss_sum(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Sum of the next-token cross-entropy over supervised positions (fp32).

    `labels` is aligned with `input_ids` (IGNORE where not supervised); position t's
    logits predict token t+1. Divide by the step's supervised-token count outside.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    shifted = logits[:, :-1, :].float()
    target = labels[:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.size(-1)),
        target.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
