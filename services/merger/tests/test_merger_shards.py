"""The shard-by-shard merge against PEFT's whole-model merge, on a tiny sharded Llama
made here (random weights, several shards), on the CPU: bit for bit in float32."""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from lorastack.errors import Refused
from merger.lora import plan_lora
from merger.shards import ShardFile, base_layout, load_adapter, merge_shards, read_shard

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def _tiny_base(folder: Path, dtype: torch.dtype, tie: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).to(dtype)
    model.save_pretrained(folder, max_shard_size="40KB")  # several shards
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return model


def _adapter(model: Any, folder: Path, **lora: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"} | lora
    peft_model = get_peft_model(model, LoraConfig(**cfg))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(folder)
    return peft_model


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (no mapping)
    return out


def _merge(base: Path, adapter: Path, out: Path, dtype: str, reader: Any = read_shard) -> Any:
    config, tensors = load_adapter(adapter)
    layout = base_layout(base)
    names = {n for h in layout.values() for n in h if n != "__metadata__"}
    tie = json.loads((base / "config.json").read_text()).get("tie_word_embeddings", False)
    plan = plan_lora(config, {k: tuple(v.shape) for k, v in tensors.items()}, names, tie)
    out.mkdir()
    return merge_shards(base, tensors, out, plan, dtype, torch.device("cpu"), reader)


class CountingReader:
    """The real reader, counting the base tensors alive at once (weakref finalizers)."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0
        self.read = 0

    def _gone(self) -> None:
        self.alive -= 1

    @contextmanager
    def __call__(self, path: Path) -> Iterator[ShardFile]:
        with read_shard(path) as f:
            outer = self

            class Counted:
                def keys(self) -> list[str]:
                    return list(f.keys())

                def get_slice(self, name: str) -> Any:
                    return f.get_slice(name)

                def metadata(self) -> dict[str, str] | None:
                    return f.metadata()

                def get_tensor(self, name: str) -> torch.Tensor:
                    t = f.get_tensor(name)
                    outer.alive += 1
                    outer.read += 1
                    outer.peak = max(outer.peak, outer.alive)
                    weakref.finalize(t, outer._gone)
                    return t

            yield Counted()


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True}, {"rank_pattern": {"q_proj": 2},
                                   "alpha_pattern": {"down_proj": 3}}])  # fmt: skip
def test_sharded_merge_equals_peft_merge_and_unload_bit_for_bit(
    tmp_path: Path, lora: dict[str, Any]
) -> None:
    base = _tiny_base(tmp_path / "base", torch.float32)
    peft_model = _adapter(base, tmp_path / "adapter", **lora)
    expected = peft_model.merge_and_unload().state_dict()
    reader = CountingReader()
    stats = _merge(tmp_path / "base", tmp_path / "adapter", tmp_path / "out", "float32", reader)

    got = _read_all(tmp_path / "out")
    assert set(got) == set(expected)
    for name, t in got.items():
        # bit for bit: the same float32 ops in the same order as PEFT (W + (B @ A) * s)
        assert torch.equal(t, expected[name]), name
    assert stats.merged == 7 * TINY["num_hidden_layers"]  # every linear of every layer
    # one base tensor alive at a time: each is released before the next is read
    assert reader.read == stats.tensors and reader.peak == 1
    # the same shard layout and index as the base
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    base_index = json.loads((tmp_path / "base" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"]
    assert index["metadata"]["total_size"] == base_index["metadata"]["total_size"]


def test_bfloat16_base_merges_in_float32_then_casts(tmp_path: Path) -> None:
    """A bf16 base: PEFT's merge upcast to float32 (as the merger's reference loads it),
    rounded to bf16 once at the end: the same bits."""
    base = _tiny_base(tmp_path / "base", torch.bfloat16)
    peft_model = _adapter(base.float(), tmp_path / "adapter")
    expected = {
        k: v.to(torch.bfloat16) for k, v in peft_model.merge_and_unload().state_dict().items()
    }
    _merge(tmp_path / "base", tmp_path / "adapter", tmp_path / "out", "bfloat16")
    for name, t in _read_all(tmp_path / "out").items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name]), name


def test_unsupported_adapters_are_refused_with_what_to_do() -> None:
    shapes = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": (4, 8),
              "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": (8, 4)}  # fmt: skip
    names = {"model.layers.0.mlp.up_proj.weight"}
    for config, said in (
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["classifier"]}, "modules_to_save"),
        ({"init_lora_weights": "pissa"}, "pissa"),
        ({"peft_type": "IA3"}, "IA3"),
    ):
        with pytest.raises(Refused) as e:
            plan_lora({"r": 4, "lora_alpha": 8} | config, shapes, names)
        assert said in e.value.message and e.value.hint
    with pytest.raises(Refused, match="no tensor for"):
        plan_lora({"r": 4, "lora_alpha": 8}, shapes, {"other.weight"})
    plan = plan_lora({"r": 4, "lora_alpha": 8}, shapes, names)
    assert plan.updates["model.layers.0.mlp.up_proj.weight"].loras[0][2] == 2.0  # alpha / r


def test_a_saved_head_copy_and_embedding_lora_merge_like_peft(tmp_path: Path) -> None:
    """modules_to_save=["lm_head"] (a full trained copy) replaces the head; a LoRA on the
    embeddings adds (B @ A).T * scaling, as PEFT's merge does."""
    base = _tiny_base(tmp_path / "base", torch.float32)
    peft_model = _adapter(
        base,
        tmp_path / "adapter",
        target_modules=["q_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
    )
    with torch.no_grad():  # a trained head copy differs from the base's head
        head = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
        head.add_(1.0)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    _merge(tmp_path / "base", tmp_path / "adapter", tmp_path / "out", "float32")
    got = _read_all(tmp_path / "out")
    for name, t in got.items():
        assert torch.equal(t, expected[name]), name
