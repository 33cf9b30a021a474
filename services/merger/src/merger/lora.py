"""Which base tensor each adapter tensor changes, and by how much: PEFT's LoRA rules over
plain data (adapter_config.json as a dict, tensor names and shapes), no files, no model.

    plan = plan_lora(adapter_config, adapter_shapes, base_names, tie_word_embeddings)
    plan.updates["model.layers.0.self_attn.q_proj.weight"] -> Update(a=..., b=..., scaling=2.0)

The delta of one module is PEFT's `get_delta_weight` (peft 0.21, tuners/lora/layer.py):

    Linear      delta = (B @ A) * scaling            A: [r, in], B: [out, r]
    Embedding   delta = (B @ A).T * scaling          A: [r, num_embeddings], B: [dim, r]
    scaling     lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; r and lora_alpha
                per module from rank_pattern / alpha_pattern (peft's get_pattern_key)

A `modules_to_save` copy of the embeddings or the head replaces the base tensor whole.
LoRA on the head of a model whose head is tied to the embeddings changes the one shared
tensor, as PEFT's merge_and_unload does (and verification then shows it). Everything
else an adapter may carry is refused with what to do instead: DoRA, LoRA bias,
fan_in_fan_out layers, weight-changing inits, trainable tokens, other modules_to_save.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorastack.errors import Refused

PREFIX = "base_model.model."  # PEFT's prefix of every saved tensor name
HEAD_COPIES = frozenset({"embed_tokens", "lm_head"})  # modules_to_save the merge handles
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")  # head -> the tensor it shares
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora): its magnitude vector rescales whole columns",
    "lora_bias": "LoRA bias (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers, GPT-2 style)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_WEIGHT_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "eva")


@dataclass(frozen=True)
class Update:
    """What happens to one base tensor: + delta of each LoRA on it, or a full copy."""

    loras: tuple[tuple[str, str, float, bool], ...] = ()  # (A name, B name, scaling, embedding)
    copy: str | None = None  # adapter tensor that replaces the base tensor


@dataclass
class LoraPlan:
    """What an adapter does to its base: the update of each base tensor it changes."""

    updates: dict[str, Update] = field(default_factory=dict)  # base tensor name -> update
    rank: int = 0  # the largest r, for the report


def _refuse(what: str, hint: str) -> Refused:
    return Refused(f"the merger does not support {what}", hint)


def _check_config(config: Mapping[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(
            f"peft_type {config.get('peft_type')!r}", "merge a LoRA adapter (peft LoraConfig)"
        )
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise _refuse(
                what, f"retrain without {key}, or serve base + adapter with PEFT unmerged"
            )
    if str(config.get("bias", "none")) != "none":
        raise _refuse(f"bias={config.get('bias')!r}", "retrain with bias='none'")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_WEIGHT_CHANGING_INITS):
        raise _refuse(
            f"init_lora_weights={init!r} (it changes the base weights when PEFT loads it)",
            "convert it to a plain LoRA first (peft path_initial_model_for_weight_conversion)",
        )
    saved = [m for m in config.get("modules_to_save") or [] if m not in HEAD_COPIES]
    if saved:
        raise _refuse(
            f"modules_to_save {saved} (only copies of {sorted(HEAD_COPIES)} are merged)",
            "retrain targeting those modules with LoRA instead of saving them whole",
        )


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns), module), default)


def scaling_of(config: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for `module` (its name in the base model) of rank `rank`."""
    r = int(_pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank)))
    if r != rank:
        raise Refused(
            f"adapter_config.json gives {module} rank {r}, its tensors rank {rank}",
            "the adapter's files disagree; save it again with peft's save_pretrained",
        )
    alpha = float(
        _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r))
    )
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def plan_lora(
    config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    base_names: set[str],
    tie_word_embeddings: bool = False,
) -> LoraPlan:
    """Map every adapter tensor (name -> shape) onto the base's tensors (`base_names`)."""
    _check_config(config)
    plan = LoraPlan()
    loras: dict[str, list[tuple[str, str, float, bool]]] = {}
    copies: dict[str, str] = {}
    for name in sorted(shapes):
        inner = name.removeprefix(PREFIX)
        for a_mark, b_mark, embedding in (
            (".lora_A.", ".lora_B.", False),
            (".lora_embedding_A", ".lora_embedding_B", True),
        ):
            if a_mark in inner:
                module = inner.split(a_mark)[0]
                b_name = name.replace(a_mark, b_mark)
                if b_name not in shapes:
                    raise Refused(f"adapter tensor {name} has no {b_mark.strip('.')}", "")
                rank = shapes[name][0]
                plan.rank = max(plan.rank, rank)
                scaling = scaling_of(config, module, rank)
                loras.setdefault(f"{module}.weight", []).append((name, b_name, scaling, embedding))
                break
        else:
            if ".lora_B." in inner or ".lora_embedding_B" in inner:
                continue  # taken with its A
            leaf = inner.rsplit(".", 2)[-2] if inner.count(".") >= 1 else inner
            if inner.endswith(".base_layer.weight") and inner.split(".")[-3] in HEAD_COPIES:
                continue  # PEFT's saved copy of a targeted embedding/head: the base's own
            if leaf in HEAD_COPIES and inner.endswith(".weight"):
                copies[inner] = name
            else:
                raise Refused(
                    f"adapter tensor {name} is neither a LoRA tensor nor a copy of "
                    f"{sorted(HEAD_COPIES)}",
                    "the merger merges LoRA adapters; retrain without extra trained modules",
                )
    _place_updates(plan, loras, copies, base_names, tie_word_embeddings)
    return plan


def _place_updates(
    plan: LoraPlan,
    loras: dict[str, list[tuple[str, str, float, bool]]],
    copies: dict[str, str],
    base_names: set[str],
    tie_word_embeddings: bool,
) -> None:
    """Add to `plan` an update of the base tensor each LoRA (by target tensor) and each
    full copy changes; refuse one the base has no tensor for, or both for one tensor."""
    for target, found in loras.items():
        target_name = target
        if target not in base_names and tie_word_embeddings and target == TIED_HEAD[0]:
            target_name = TIED_HEAD[1]  # PEFT's merge changes the tensor the head shares
        if target_name not in base_names:
            raise Refused(
                f"the adapter changes {target}, which the base has no tensor for",
                "merge the adapter into the base it was trained on",
            )
        plan.updates[target_name] = Update(loras=tuple(found))
    for target, name in copies.items():
        if target not in base_names:
            raise Refused(f"the adapter's copy {name} replaces no tensor of the base", "")
        if target in plan.updates:
            raise _refuse(f"both a LoRA and a full copy of {target}", "retrain with one of them")
        plan.updates[target] = Update(copy=name)
