"""Pure checks over plain data: may this adapter be merged into this base, and may vLLM
serve it as a LoRA adapter?

Owns: the base-digest check, quantized-base detection (from config.json and the
safetensors headers' tensor names and dtypes) and the vLLM loadability rules for an
adapter (adapter_config.json fields plus the tensor names in adapter_model.safetensors).
It reads no files: `merge.py` and `cli.py` parse them and pass dicts and lists in.

The vLLM rules mirror vLLM 0.32 (`vllm/lora/peft_helper.py`, `lora_model.py`): rank at
most the server's --max-lora-rank (one of 1, 8, 16, 32, 64, 128, 256, 320, 512), LoRA
only on linear layers and the embedding LoRA layers, modules_to_save only for
classification heads, no DoRA, no LoRA bias, no aLoRA, no layer replication, no
weight-modifying inits (PiSSA, OLoRA, LoftQ, ...), no trainable-token deltas, and no
vocabulary beyond the base's (vLLM 0.32 has no extra-vocab option for LoRA).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lorastack.errors import Refused
from lorastack.manifest import Manifest, Parent
from lorastack.serving import VLLM_MAX_LORA_RANKS

# ---- the base ---------------------------------------------------------------------


def check_base_digest(expected: Parent, found: Manifest) -> None:
    """Refuse when the stored base is not the bytes the adapter was trained on."""
    if found.digest != expected.digest:
        raise Refused(
            f"base model {found.ref} in the store has digest {found.digest}, but the adapter "
            f"was trained on {expected.name}:{expected.version} with digest {expected.digest}",
            "the base was re-published or altered since training; merge into the exact base "
            "the adapter was trained on (publish those files again under that name and "
            "version), or retrain the adapter on the current base",
        )


# Tensor-name fragments that only quantized checkpoints carry: bitsandbytes 4-bit
# (absmax, quant_map, quant_state) and 8-bit (SCB, weight_format), GPTQ/AWQ (qweight,
# qzeros, scales), compressed-tensors (weight_packed).
_QUANT_TENSOR_MARKERS = (
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_state.",
    ".SCB",
    ".weight_format",
    ".qweight",
    ".qzeros",
    ".weight_packed",
)
_INT_DTYPES = {"U8", "I8", "U4", "I4", "F8_E4M3", "F8_E5M2"}  # safetensors header dtypes


def base_quantization(config: Mapping[str, Any], tensors: Mapping[str, str]) -> str | None:
    """Describe how the base is quantized, or None for plain float weights.

    `config` is config.json; `tensors` maps each tensor name to its safetensors dtype
    (e.g. "F32", "BF16", "U8").
    """
    q = config.get("quantization_config")
    if q:
        method = str(q.get("quant_method", "unknown"))
        if q.get("load_in_4bit") or q.get("bnb_4bit_quant_type"):
            return f"{method} 4-bit ({q.get('bnb_4bit_quant_type', 'fp4')})"
        if q.get("load_in_8bit"):
            return f"{method} 8-bit"
        bits = q.get("bits") or q.get("w_bit")
        return f"{method} {bits}-bit" if bits else method
    marked = sorted(n for n in tensors if any(m in n for m in _QUANT_TENSOR_MARKERS))
    if marked:
        return f"quantized weights (e.g. tensor {marked[0]})"
    ints = sorted(n for n, d in tensors.items() if n.endswith(".weight") and d in _INT_DTYPES)
    if ints:
        return f"integer weights ({tensors[ints[0]]} tensor {ints[0]})"
    return None


def refuse_quantized_base(ref: str, config: Mapping[str, Any], tensors: Mapping[str, str]) -> None:
    """Raise Refused when the base's config or tensors are quantized (nf4, int8, ...)."""
    found = base_quantization(config, tensors)
    if found:
        raise Refused(
            f"base model {ref} is quantized ({found}); merging into it would ship a degraded model",
            "merge into the unquantised (float32/bfloat16) base the adapter was trained from "
            "(a QLoRA adapter trains against a 4-bit view of that same base). Merged into "
            "4-bit/8-bit weights, the small LoRA delta is rounded away by the quantisation "
            "grid and the dequantisation error of every weight is baked in for good",
        )


# ---- vLLM multi-LoRA serving --------------------------------------------------------

_LLAMA_LIKE = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
_PHI3 = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
# Linear layers vLLM wraps with LoRA layers, by HF architecture (vLLM 0.32: every
# LinearBase; q/k/v and gate/up are packed, and the adapter keeps the HF names).
VLLM_LORA_MODULES: dict[str, frozenset[str]] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "GemmaForCausalLM": _LLAMA_LIKE,
    "Gemma2ForCausalLM": _LLAMA_LIKE,
    "Phi3ForCausalLM": _PHI3,
}
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head"})  # vLLM's embedding LoRA layers
CLASSIFIER_MODULES = frozenset({"classifier", "score"})  # the only modules_to_save vLLM takes
_WEIGHT_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")  # change the base at load
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "use_qalora": "QALoRA (use_qalora)",
}


@dataclass(frozen=True)
class Finding:
    """One problem a check found, with what to do about it."""

    level: Literal["error", "warning"]
    message: str
    hint: str


def smallest_vllm_rank(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM accepts that fits `rank`, or None if none does."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)


def _module_of(tensor: str) -> tuple[str, bool]:
    """('model.layers.0.self_attn.q_proj', is_lora) for a PEFT tensor name."""
    name = tensor.removeprefix("base_model.model.")
    for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B"):
        if marker in name:
            return name.split(marker)[0], True
    return name.rsplit(".", 1)[0], False


def check_adapter_for_vllm(
    adapter_config: Mapping[str, Any],
    tensor_names: Iterable[str],
    *,
    architecture: str,
    max_lora_rank: int,
    base_vocab_size: int | None = None,
    adapter_vocab_size: int | None = None,
) -> list[Finding]:
    """Everything that would stop vLLM from loading this adapter, with what to change."""
    out = _check_fields(adapter_config, max_lora_rank)
    out += _check_full_training(adapter_config)
    out += _check_tensors(tensor_names, adapter_config, architecture)
    if base_vocab_size and adapter_vocab_size and adapter_vocab_size > base_vocab_size:
        out.append(
            Finding(
                "error",
                f"the adapter's tokenizer has {adapter_vocab_size} tokens, the base "
                f"{base_vocab_size}; vLLM 0.32 serves LoRA adapters with the base vocabulary "
                "only (there is no extra-vocabulary option)",
                "merge the adapter and serve the merged model, or retrain without adding tokens",
            )
        )
    return out


def _check_fields(adapter_config: Mapping[str, Any], max_lora_rank: int) -> list[Finding]:
    """The config's LoRA fields vLLM reads: present, a LoRA, a rank the server takes, no
    bias."""
    out: list[Finding] = []
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in adapter_config]
    if missing:
        out.append(
            Finding(
                "error",
                f"adapter_config.json lacks {', '.join(missing)}, which vLLM requires",
                "save the adapter with peft's save_pretrained (it writes every field)",
            )
        )
    if adapter_config.get("peft_type", "LORA") != "LORA":
        out.append(
            Finding(
                "error",
                f"peft_type is {adapter_config.get('peft_type')!r}; vLLM serves LoRA only",
                "train a LoRA adapter (peft LoraConfig), or merge this one into the base",
            )
        )
    ranks = [
        int(adapter_config.get("r") or 0),
        *(adapter_config.get("rank_pattern") or {}).values(),
    ]
    rank = max(int(r) for r in ranks)
    if rank > max_lora_rank:
        fit = smallest_vllm_rank(rank)
        serve = f"start vLLM with --max-lora-rank {fit}" if fit else "no vLLM rank fits"
        out.append(
            Finding(
                "error",
                f"LoRA rank {rank} is above the server's --max-lora-rank {max_lora_rank}",
                f"{serve}, or retrain with r <= {max_lora_rank}, or merge the adapter "
                "(lorastack merge) and serve the merged model",
            )
        )
    if str(adapter_config.get("bias", "none")) != "none":
        out.append(
            Finding(
                "error",
                f"bias={adapter_config.get('bias')!r}: vLLM does not load adapter biases",
                "retrain with bias='none', or merge the adapter and serve the merged model",
            )
        )
    return out


def _check_full_training(adapter_config: Mapping[str, Any]) -> list[Finding]:
    """What the config trains beyond LoRA deltas (options, weight-changing inits, full
    modules, embedding rows), which vLLM cannot load."""
    out: list[Finding] = []
    for key, what in _UNSUPPORTED_FLAGS.items():
        if adapter_config.get(key):
            out.append(
                Finding(
                    "error",
                    f"vLLM does not support {what}",
                    "retrain without it, or merge the adapter and serve the merged model",
                )
            )
    init = adapter_config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_WEIGHT_CHANGING_INITS):
        out.append(
            Finding(
                "error",
                f"init_lora_weights={init!r} changes the base weights when PEFT loads it",
                "convert it to a plain LoRA (peft path_initial_model_for_weight_conversion) "
                "or merge it and serve the merged model",
            )
        )
    saved = [m for m in adapter_config.get("modules_to_save") or [] if m not in CLASSIFIER_MODULES]
    if saved:
        out.append(
            Finding(
                "error",
                f"the adapter trains full modules {saved} (modules_to_save); vLLM serves only "
                "LoRA deltas (modules_to_save only for classifier heads)",
                "merge the adapter (lorastack merge) and serve the merged model, or retrain "
                "without modules_to_save (target the embeddings with LoRA instead)",
            )
        )
    if adapter_config.get("trainable_token_indices"):
        out.append(
            Finding(
                "error",
                "the adapter trains embedding rows (trainable_token_indices), which vLLM "
                "cannot load",
                "merge the adapter and serve the merged model, or retrain without "
                "trainable_token_indices",
            )
        )
    return out


def _check_tensors(
    tensor_names: Iterable[str], adapter_config: Mapping[str, Any], architecture: str
) -> list[Finding]:
    supported = VLLM_LORA_MODULES.get(architecture)
    out: list[Finding] = []
    if supported is None:
        out.append(
            Finding(
                "warning",
                f"architecture {architecture!r} is not in lorastack's table of vLLM LoRA "
                "modules; its linear layers are probably supported",
                "load the adapter once on a test server (POST /v1/load_lora_adapter) "
                "before relying on it",
            )
        )
    lora_modules: set[str] = set()
    full: set[str] = set()
    for t in tensor_names:
        module, is_lora = _module_of(t)
        (lora_modules if is_lora else full).add(module)
    if not lora_modules:
        out.append(
            Finding(
                "error",
                "adapter_model.safetensors holds no LoRA tensors (lora_A / lora_B)",
                "save the trained PeftModel with save_pretrained",
            )
        )
    leaves = {m.rsplit(".", 1)[-1] for m in lora_modules}
    if supported is not None:
        bad = sorted(leaves - supported - EMBEDDING_MODULES)
        if bad:
            out.append(
                Finding(
                    "error",
                    f"LoRA on {bad}, which vLLM has no LoRA layer for in {architecture} "
                    f"(it supports {sorted(supported | EMBEDDING_MODULES)})",
                    "retrain targeting only those modules, or merge the adapter and serve "
                    "the merged model",
                )
            )
    out += _check_full_weights(full, adapter_config)
    return out


def _check_full_weights(full: set[str], adapter_config: Mapping[str, Any]) -> list[Finding]:
    """The full (non-LoRA) weights in the tensors that the config does not explain (a
    classifier head, modules_to_save, trainable tokens)."""
    out: list[Finding] = []
    saved = set(adapter_config.get("modules_to_save") or [])
    full_leaves = {m.rsplit(".", 1)[-1] for m in full}
    if adapter_config.get("trainable_token_indices"):
        saved.add("token_adapter")  # reported above from the config
    unexplained = sorted(full_leaves - CLASSIFIER_MODULES - saved)
    if unexplained:
        out.append(
            Finding(
                "error",
                f"adapter_model.safetensors holds full (non-LoRA) weights for {unexplained}",
                "vLLM loads only lora_A/lora_B tensors; merge the adapter and serve the "
                "merged model",
            )
        )
    return out
