"""The only module that builds models and computes the loss.

`load_model` is the one place a base model is loaded (fp32 on CPU, bf16 on CUDA;
nf4 + double quant for QLoRA, same code path) and wrapped with LoRA. `loss_sum` is the
one place the loss is computed. Both are the fast path, on CPU and CUDA alike
(bench/trainer_gpu.py measures it against the plain transformers+peft recipe):

- no `prepare_model_for_kbit_training`: it upcasts every non-quantized weight
  (embeddings, norms, a 128k-vocabulary lm_head) to fp32, which costs memory and runs
  the output projection in fp32; the frozen weights stay in the compute dtype;
- LoRA weights stay fp32 (the optimizer's master copy) but compute in the compute dtype
  under autocast, instead of peft casting every adapter input up to fp32 (on CUDA that
  cast doubled the saved activations);
- each LoRA linear is one autograd node (trainer.fast_lora): at batch 1 on a GPU the
  step was bound by peft's and bitsandbytes' per-op Python, not by the GPU;
- gradient checkpointing is non-reentrant, per decoder layer;
- the cross-entropy never materialises the full logits (trainer.cross_entropy): only
  supervised positions go through lm_head, in recomputed chunks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lorastack.errors import ConfigError
from trainer import fast_lora
from trainer.config import RunConfig
from trainer.cross_entropy import linear_cross_entropy_sum


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
    from peft import LoraConfig, get_peft_model
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
    if config.quantization != "nf4":
        model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)  # only the LoRA weights train
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    if use_compile(config, device):
        compile_decoder(peft_model, config.compile_scope)
    return peft_model


def use_compile(config: RunConfig, device: torch.device) -> bool:
    """Whether the run compiles its decoder layers (config `compile`: true, false, auto).

    auto = on CUDA with gradient checkpointing, where it was measured (bench/trainer_gpu.py,
    H200, 8B shape, batch 1: 2.5x the plain path's tokens/s at 10.2 GiB with the whole
    decoder compiled, see compile_decoder; LoRA gradients as close to an fp32 reference
    as eager bf16's). Off without checkpointing:
    there AOT autograd's CSE merges the forward's and backward's nf4 dequantisation and
    keeps the weights for backward (8B: 29.0 GiB against eager's 18.8). Off on CPU (a
    long first compile for little gain). Both need a compiler (Triton builds its launcher
    with a C compiler; inductor's CPU code is C++): auto without one stays eager, true
    without one is a ConfigError."""
    choice = config.compile
    auto_off = device.type != "cuda" or not config.gradient_checkpointing
    if choice is False or (choice == "auto" and auto_off):
        return False
    env, *names = ("CC", "gcc", "clang") if device.type == "cuda" else ("CXX", "g++", "clang++")
    found = any(shutil.which(n) for n in (os.environ.get(env), *names) if n)
    if not found and choice is True:
        raise ConfigError(
            f"compile=true on {device.type} needs a compiler ({' or '.join(names)}, or "
            f"${env}) and none is on PATH",
            f"install {names[0]}, or set compile=false",
        )
    return found


# AOT autograd's activation_memory_budget for the whole-decoder graph: at its default
# (1.0) the partitioner saved each checkpointed layer's matmul outputs (gate, up, q/o- and
# k/v-sized) rather than recompute them, 12.7 GiB on the 8B shape; 0.5 kept 10.2 GiB at
# 2.5x the baseline (bench/trainer_gpu_saved.py, bench/results/trainer-gpu-2026-12-01.json)
DECODER_ACTIVATION_BUDGET = 0.5


def compile_decoder(model: Any, scope: str) -> None:
    """torch.compile the decoder for training (evaluation and generation, with their
    caches and one-token shapes, stay eager). A batch of a new width costs one recompile,
    after which dynamo treats the width as dynamic.

    scope "decoder" (the default): the whole decoder as one graph, checkpointing inside
    it, compiled with AOT autograd's CSE off (with it, the forward's and backward's nf4
    dequantisations merged and the 8B shape peaked at 25.7 GiB) and an activation budget
    of DECODER_ACTIVATION_BUDGET. On an H200, 8B shape, batch 1: 9,066 tokens/s (2.51x
    the plain path) at 10.2 GiB, after a 172 s first compile and a 235 s recompile at the
    next width; 1B: 16,453 tokens/s after 75 s. scope "layers": one graph per decoder
    layer, shared by all layers, called inside the per-layer checkpointing: 15 s to
    compile, 7.9 GiB, 1.65-2.41x on 8B (bound by the host, so it varies by machine)
    (bench/results/trainer-gpu-2026-12-01.json, -2026-11-30-session3.json)."""
    import torch._functorch.config
    import torch._inductor.config

    # dropout through torch's own RNG ops: the eager masks, replayed by checkpointing
    torch._inductor.config.fallback_random = True
    decoder = model.get_base_model().get_decoder()
    modules = [decoder] if scope == "decoder" else list(getattr(decoder, "layers", []))
    for module in modules:
        eager = module.forward
        compiled = torch.compile(eager)

        def forward(
            *args: Any, _m: Any = module, _c: Any = compiled, _e: Any = eager, **kw: Any
        ) -> Any:
            if not _m.training:
                return _e(*args, **kw)
            if scope != "decoder":
                return _c(*args, **kw)
            # the joint graph is partitioned at the forward's compile: settings from there
            budget = DECODER_ACTIVATION_BUDGET
            with torch._functorch.config.patch(cse=False, activation_memory_budget=budget):
                return _c(*args, **kw)

        module.forward = forward


def loss_sum(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Sum of the next-token cross-entropy over supervised positions (fp32).

    `labels` is aligned with `input_ids` (IGNORE where not supervised); position t's
    hidden state predicts token t+1. Divide by the step's supervised-token count outside.
    """
    base = model.get_base_model()
    head = base.get_output_embeddings().weight
    low = head.dtype != torch.float32  # bf16 compute on CUDA, fp32 on CPU
    with torch.autocast(input_ids.device.type, dtype=head.dtype, enabled=low):
        out = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
        return linear_cross_entropy_sum(out.last_hidden_state, head, labels)
