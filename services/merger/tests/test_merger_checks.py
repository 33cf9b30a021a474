"""Pure rules, table-driven: quantized bases, vLLM loadability, stop tokens, verdicts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from merger.card import stop_token_ids
from merger.checks import base_quantization, check_adapter_for_vllm, smallest_vllm_rank
from merger.merge import default_name
from merger.verify import Comparison, first_divergence, judge

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_tensors(modules: list[str], layers: int = 2) -> list[str]:
    return [
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
        for i in range(layers)
        for m in modules
        for ab in "AB"
    ]


def adapter_config(**over: Any) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": QKVO,
        "bias": "none",
    } | over


@pytest.mark.parametrize(
    ("config", "tensors", "expected"),
    [
        ({}, {"model.layers.0.mlp.up_proj.weight": "F32"}, None),
        (
            {
                "quantization_config": {
                    "quant_method": "bitsandbytes",
                    "load_in_4bit": True,
                    "bnb_4bit_quant_type": "nf4",
                }
            },
            {},
            "bitsandbytes 4-bit (nf4)",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
            {},
            "8-bit",
        ),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, {}, "gptq 4-bit"),
        ({}, {"model.layers.0.mlp.up_proj.weight.absmax": "F32"}, "quantized weights"),
        ({}, {"model.layers.0.mlp.up_proj.weight": "U8"}, "integer weights"),
    ],
)
def test_base_quantization(
    config: dict[str, Any], tensors: dict[str, str], expected: str | None
) -> None:
    found = base_quantization(config, tensors)
    assert found == expected if expected is None else expected in (found or "")


def findings(config: dict[str, Any], tensors: list[str], **kw: Any) -> list[str]:
    kw = {"architecture": "LlamaForCausalLM", "max_lora_rank": 16} | kw
    return [
        f"{f.level}: {f.message} | {f.hint}" for f in check_adapter_for_vllm(config, tensors, **kw)
    ]


def test_clean_adapter_has_no_findings() -> None:
    assert findings(adapter_config(), lora_tensors(QKVO)) == []


@pytest.mark.parametrize(
    ("config", "tensors", "kw", "needle"),
    [
        (adapter_config(r=32), lora_tensors(QKVO), {}, "--max-lora-rank 32"),
        (adapter_config(r=12), lora_tensors(QKVO), {"max_lora_rank": 8}, "--max-lora-rank 16"),
        (adapter_config(rank_pattern={"q_proj": 64}), lora_tensors(QKVO), {}, "rank 64"),
        (
            adapter_config(modules_to_save=["embed_tokens", "lm_head"]),
            [*lora_tensors(QKVO), "base_model.model.model.embed_tokens.weight"],
            {},
            "modules_to_save",
        ),
        (
            adapter_config(trainable_token_indices=[5, 6]),
            [
                *lora_tensors(QKVO),
                "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
            ],
            {},
            "trainable_token_indices",
        ),
        (adapter_config(use_dora=True), lora_tensors(QKVO), {}, "DoRA"),
        (adapter_config(bias="lora_only"), lora_tensors(QKVO), {}, "bias"),
        (adapter_config(init_lora_weights="pissa"), lora_tensors(QKVO), {}, "pissa"),
        (adapter_config(peft_type="IA3"), lora_tensors(QKVO), {}, "LoRA only"),
        ({"r": 8, "target_modules": QKVO}, lora_tensors(QKVO), {}, "lacks lora_alpha"),
        (adapter_config(), lora_tensors(["rotary_emb"]), {}, "no LoRA layer"),
        (adapter_config(), [], {}, "no LoRA tensors"),
        (
            adapter_config(),
            lora_tensors(QKVO),
            {"base_vocab_size": 49152, "adapter_vocab_size": 49154},
            "extra-vocabulary",
        ),
    ],
)
def test_unloadable_adapters_say_what_to_change(
    config: dict[str, Any], tensors: list[str], kw: dict[str, Any], needle: str
) -> None:
    got = findings(config, tensors, **kw)
    assert any(f.startswith("error") and needle in f for f in got), got


def test_lora_on_embeddings_is_served_but_unknown_architecture_warns() -> None:
    emb = [
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.embed_tokens.lora_embedding_B",
    ]
    assert findings(adapter_config(), [*lora_tensors(QKVO), *emb]) == []
    got = findings(adapter_config(), lora_tensors(QKVO), architecture="FancyForCausalLM")
    assert len(got) == 1 and got[0].startswith("warning")


def test_smallest_vllm_rank() -> None:
    assert [smallest_vllm_rank(r) for r in (1, 2, 8, 9, 300, 513)] == [1, 8, 8, 16, 320, None]


CHATML = "{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>'}}"
LLAMA3 = (
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] + '<|eot_id|>' }}"
)


@pytest.mark.parametrize(
    ("eos", "configured", "template", "expected"),
    [
        (2, 2, CHATML, [2]),
        (0, None, CHATML, [0, 2]),  # eos is <|endoftext|>: the end of turn is added
        (128001, [128001, 128008], LLAMA3, [128001, 128008, 128009]),
        (None, None, "no special tokens", []),
    ],
)
def test_stop_tokens_include_end_of_turn(
    eos: int | None, configured: int | list[int] | None, template: str, expected: list[int]
) -> None:
    vocab = {"<|endoftext|>": 0, "<|im_end|>": 2, "<|eot_id|>": 128009, "<|end|>": 7}
    assert stop_token_ids(eos, configured, template, vocab) == expected


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def comparison(max_abs: float, top1: float, greedy_same: int = 2, probes: int = 2) -> Comparison:
    c = Comparison()
    ref = torch.zeros(100, 4)
    ref[:, 0] = 0.01  # argmax 0 by a margin of 0.01 logit
    other = ref.clone()
    other[-1, 1] += max_abs
    flips = round((1 - top1) * 100)
    other[:flips, 3] = 0.02  # flips the argmax, |Δ| 0.02 <= max_abs in every case
    c.add_logits(ref, other)
    c.divergences = [None] * greedy_same + [3] * (probes - greedy_same)
    return c


@pytest.mark.parametrize(
    ("dtype", "merged", "dtype_only", "passed", "needle"),
    [
        ("float32", comparison(1e-4, 1.0), None, True, ""),
        ("float32", comparison(0.5, 1.0), None, False, "max |Δlogit| 0.5 > 0.01"),
        ("float32", comparison(1e-4, 1.0, greedy_same=1), None, False, "greedy"),
        ("bfloat16", comparison(2.0, 0.98, 0), comparison(3.0, 0.98), True, ""),
        ("bfloat16", comparison(3.0, 0.99), comparison(1.0, 0.99), False, "2 x the bfloat16 error"),
        ("bfloat16", comparison(1.0, 0.94), comparison(1.0, 1.0), True, ""),
        ("bfloat16", comparison(1.0, 0.84), comparison(1.0, 0.90), False, "top-1 agreement"),
        # the dtype alone agrees on 80% (random 8B weights, bench/merger): 78% passes, 74% not
        ("bfloat16", comparison(0.46, 0.79), comparison(0.49, 0.81), True, ""),
        ("bfloat16", comparison(0.46, 0.75), comparison(0.49, 0.81), False, "< 75.0%"),
        # the dtype alone agrees on 8% only: the floor stops at 50%, so a scrambled merge
        # (chance agreement, its logits within the dtype's own error) still fails
        ("bfloat16", comparison(0.40, 0.05), comparison(0.49, 0.08), False, "< 50.0%"),
        ("bfloat16", comparison(0.40, 0.52), comparison(0.49, 0.40), True, ""),
        ("float16", comparison(0.40, 0.05), comparison(0.49, 0.08), False, "< 50.0%"),
        ("float16", comparison(3.0, 0.99), comparison(3.0, 0.99), False, "> 2"),
    ],
)
def test_judge_by_dtype(
    dtype: str, merged: Comparison, dtype_only: Comparison | None, passed: bool, needle: str
) -> None:
    v = judge(dtype, merged, dtype_only)
    assert v.passed is passed, v.failures
    assert passed != bool(v.advice)
    assert needle in " ".join(v.failures)


def test_nonfinite_logits_fail_half_precision() -> None:
    c = Comparison()
    ref = torch.zeros(3, 4)
    other = ref.clone()
    other[1, 2] = float("inf")
    c.add_logits(ref, other)
    v = judge("float16", c, comparison(0.1, 1.0))
    assert not v.passed and "inf/nan" in v.failures[0] and c.summary()["max_abs_logit_diff"] is None
    assert any("bfloat16" in a for a in v.advice)


def test_default_name() -> None:
    assert default_name("run1/adapter") == "run1/merged"
    assert default_name("mine") == "mine/merged"
