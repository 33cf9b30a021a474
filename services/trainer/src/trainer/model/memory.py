"""Memory and disk estimates before a run: pure arithmetic over the model's config.json.

The breakdown (bytes): weights by dtype/quantisation, LoRA parameters, their gradients,
AdamW state, activations and logits (and, sharded by FSDP, the weights gathered whole).
Activations are a rule of thumb (per token per layer ~ (10*hidden + 4*intermediate)
values kept for backward; one layer's worth with gradient checkpointing, for the layers
it covers); the measured peak at the end says how close it was. `plan_checkpointing`
picks how many layers to recompute so the estimate fits.
"""

from __future__ import annotations

from typing import Any

from trainer.model.cross_entropy import CHUNK_ELEMENTS

NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4 bits + double-quantised absmax (~0.127 bits)
# bytes: cuBLAS and cuBLASLt workspaces, taken from torch's allocator at the first matmul
# (one each; their size on Hopper, bench/trainer/README.md)
CUDA_WORKSPACE = 64 << 20
# Eager fp32 steps on the CPU: the peak RSS they add over the tensors autograd keeps (the
# C allocator holds on to freed forward and backward temporaries; the factor is the
# demo's, bench/trainer/README.md). On a GPU torch's allocator is measured, and no factor
# applies.
CPU_RSS_FACTOR = 1.9
# gradient_checkpointing auto plans for this share of the GPU's free memory: the estimate
# is only within ~10% of real peaks (tests/test_trainer_records.py holds the cases), and
# the allocator needs room to move
PLAN_HEADROOM = 0.8


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear module of one Llama-style layer."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    return {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def lora_params(cfg: dict[str, Any], r: int, targets: list[str]) -> int:
    """LoRA parameters of a model: rank r on each targeted linear of every layer."""
    shapes = linear_shapes(cfg)
    per_layer = sum(r * (i + o) for name, (i, o) in shapes.items() if name in targets)
    return per_layer * int(cfg["num_hidden_layers"])


def base_params(cfg: dict[str, Any]) -> tuple[int, int]:
    """(params in the layers' linear modules, all other params) of the base model."""
    layers = int(cfg["num_hidden_layers"])
    h = int(cfg["hidden_size"])
    linear = layers * sum(i * o for i, o in linear_shapes(cfg).values())
    embed = int(cfg["vocab_size"]) * h
    other = embed * (1 if cfg.get("tie_word_embeddings", False) else 2) + layers * 2 * h + h
    return linear, other


def _weight_bytes(
    cfg: dict[str, Any], quantization: str, compute_bytes: int, shards: int
) -> tuple[int, int]:
    """The base weights' bytes on one device, and those FSDP gathers whole while they run
    (two layers and the root's own weights; 0 unsharded)."""
    linear, other = base_params(cfg)
    if quantization == "nf4":
        weights = int(linear * NF4_BYTES_PER_PARAM) + other * compute_bytes
    else:
        weights = (linear + other) * compute_bytes
    if shards <= 1:
        return weights, 0
    layers = int(cfg["num_hidden_layers"])
    return weights // shards, (2 * linear // layers + other) * compute_bytes


def estimate(
    cfg: dict[str, Any],
    *,
    r: int,
    targets: list[str],
    quantization: str,
    compute_bytes: int,  # 4 for fp32 compute (CPU), 2 for bf16 (CUDA)
    micro_batch: int,
    seq_len: int,
    checkpointed: int,
    cuda: bool = False,
    shards: int = 1,
    lora_dropout: float = 0.0,
) -> dict[str, int]:
    """Bytes per part and the total, for one device. `checkpointed`: how many decoder
    layers recompute their activations in backward (the rest keep theirs; a recomputed
    layer holds its own while its backward runs). `shards`: the processes FSDP shards
    the weights, LoRA weights and AdamW state over (trainer.model.sharding); each device then
    also holds two layers gathered whole (the one running and the next, prefetched) and
    the root's own weights (embeddings, final norm, lm_head) whole while it runs."""
    layers = int(cfg["num_hidden_layers"])
    weights, gathered = _weight_bytes(cfg, quantization, compute_bytes, shards)
    lp = lora_params(cfg, r, targets) // shards
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    tokens = micro_batch * seq_len
    per_layer = tokens * (10 * h + 4 * inter) * compute_bytes
    if lora_dropout > 0:  # each adapted linear keeps its dropped input and the mask
        shapes = linear_shapes(cfg)
        inputs = sum(shapes[t][0] for t in targets if t in shapes)
        per_layer += tokens * inputs * (compute_bytes + 1)
    checkpointed = min(max(checkpointed, 0), layers)
    kept_layers = layers - checkpointed + (1 if checkpointed else 0)
    activations = per_layer * kept_layers + (layers * tokens * h * compute_bytes)
    if not cuda:
        activations = int(activations * CPU_RSS_FACTOR)
    # the loss sends at most CHUNK_ELEMENTS logits through lm_head at a time
    # (trainer.model.cross_entropy): fp32 logits, softmax and gradient of one chunk
    logits = min(tokens * int(cfg["vocab_size"]), CHUNK_ELEMENTS) * 4 * 3
    parts = {
        "weights": weights,
        "gathered": gathered,
        "lora_params": lp * 4,  # adapters stay fp32
        "lora_grads": lp * 4,
        "optimizer": lp * 4 * 2,  # AdamW exp_avg + exp_avg_sq
        "activations": activations,
        "logits": logits,
        "workspace": CUDA_WORKSPACE if cuda else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def plan_checkpointing(cfg: dict[str, Any], budget: int, **estimate_args: Any) -> int:
    """The fewest decoder layers to recompute in backward for `estimate(cfg, ...)` to fit
    in `budget` bytes: 0 when everything fits, all layers when even that does not."""
    layers = int(cfg["num_hidden_layers"])
    for n in range(layers + 1):
        if estimate(cfg, **estimate_args, checkpointed=n)["total"] <= budget:
            return n
    return layers


PARTS = {  # a measurable part: the parts of the estimate it holds
    "weights_and_adapter": ("weights", "lora_params"),
    "optimizer": ("optimizer", "workspace"),  # what stays after the first step
    # what one step holds at its peak
    "step": ("activations", "logits", "lora_grads", "gathered"),
    "total": ("total",),
}


def against_measured(
    estimated: dict[str, int], measured: dict[str, int | None]
) -> dict[str, dict[str, float | int | None]]:
    """Each measurable part of the estimate next to its measurement (bytes), as {part:
    {estimate, measured, error}}; error = measured / estimate - 1, None where nothing was
    measured."""
    out: dict[str, dict[str, float | int | None]] = {}
    for part, names in PARTS.items():
        est, got = sum(estimated.get(n, 0) for n in names), measured.get(part)
        err = round(got / est - 1, 3) if got is not None and est > 0 else None
        out[part] = {"estimate": est, "measured": got, "error": err}
    return out


def checkpoint_bytes(lora_param_count: int) -> int:
    """Adapter + AdamW state, fp32, plus ~1 MB of RNG states and json."""
    return lora_param_count * 4 * 3 + (1 << 20)


def human(n: float) -> str:
    """A byte count for people: '512 B', '1.5 GB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
