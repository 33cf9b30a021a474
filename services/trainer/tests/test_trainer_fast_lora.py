"""The fused LoRA linear (trainer.model.fast_lora) computes what peft computes: same loss, same
LoRA gradients, on a dense and on an nf4 base, with dropout and checkpointing; and peft's
own forward still runs where the fused one does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorastack.errors import ConfigError
from trainer.config import RunConfig
from trainer.model import fast_lora
from trainer.model.compiling import compile_decoder, use_compile
from trainer.model.modeling import load_model, loss_sum


def build(path: Path, fused: bool, checkpointed: int | None = None, **fields: Any) -> Any:
    config = RunConfig.model_validate(
        {"dataset": {"path": "unused.jsonl"}, "device": "cpu", "fused_lora": fused, **fields}
    )
    model = load_model(path, config, torch.device("cpu"), checkpointed=checkpointed)
    if config.compile is True:
        compile_decoder(model, config.compile_scope)
    torch.manual_seed(1)  # peft initialises B to zero: make every gradient non-trivial
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    model.train()
    return model


def loss_and_grads(model: Any) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (2, 24))
    labels = ids.clone()
    labels[:, :6] = -100
    torch.manual_seed(3)  # dropout masks
    loss = loss_sum(model, ids, torch.ones_like(ids), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss), grads


@pytest.mark.parametrize(
    "fields",
    [
        {"quantization": "none", "lora": {"dropout": 0.0}},
        {"quantization": "none", "lora": {"dropout": 0.1}, "gradient_checkpointing": True},
        {"quantization": "nf4", "lora": {"dropout": 0.0}},
        {"quantization": "nf4", "lora": {"dropout": 0.1}, "gradient_checkpointing": True},
    ],
    ids=["dense", "dense-dropout-ckpt", "nf4", "nf4-dropout-ckpt"],
)
def test_fused_lora_equals_peft(
    tiny_llama: Path, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    loss_p, grads_p = loss_and_grads(build(tiny_llama, False, **fields))
    calls = []
    apply = fast_lora.LoraLinearFunction.apply
    monkeypatch.setattr(
        fast_lora.LoraLinearFunction, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    loss_f, grads_f = loss_and_grads(build(tiny_llama, True, **fields))
    recomputed = 2 if fields.get("gradient_checkpointing") else 1
    assert len(calls) == 14 * recomputed  # every LoRA linear took the fused path
    assert len(grads_f) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    assert loss_f == pytest.approx(loss_p, rel=1e-6)
    for name, g in grads_p.items():
        assert g.abs().max() > 0, name
        assert grads_f[name].dtype == torch.float32
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_some_layers_checkpointed_give_the_same_gradients(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gradient_checkpointing auto recomputes only the first layers the memory plan names:
    with one of the two checkpointed, only its 7 LoRA linears run twice, and the loss and
    gradients are those of no checkpointing (dropout masks replayed)."""
    fields = {"quantization": "nf4", "lora": {"dropout": 0.1}}
    loss_0, grads_0 = loss_and_grads(build(tiny_llama, True, checkpointed=0, **fields))
    calls = []
    apply = fast_lora.LoraLinearFunction.apply
    monkeypatch.setattr(
        fast_lora.LoraLinearFunction, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    model = build(tiny_llama, True, checkpointed=1, **fields)
    layers = model.get_base_model().get_decoder().layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    loss_1, grads_1 = loss_and_grads(model)
    assert len(calls) == 14 + 7
    assert loss_1 == pytest.approx(loss_0, rel=1e-6)
    for name, g in grads_0.items():
        torch.testing.assert_close(grads_1[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_disabled_adapter_falls_back_to_peft(tiny_llama: Path) -> None:
    """peft's disable_adapter() (the base model's answer) still works through the fused
    layers: the output equals a model with B = 0."""
    model = build(tiny_llama, True)
    model.eval()
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.zero_()
        zero_b = model(input_ids=ids).logits
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(base, zero_b)


@pytest.mark.parametrize("scope", ["layers", "decoder"])
def test_compiled_decoder_gives_the_eager_gradients(tiny_llama: Path, scope: str) -> None:
    """compile=true trains through torch.compile'd decoder layers, or the whole decoder:
    the eager loss and LoRA gradients (dropout and checkpointing included); evaluation
    runs the eager forward."""
    fields = {"quantization": "nf4", "gradient_checkpointing": True, "lora": {"dropout": 0.1}}
    loss_e, grads_e = loss_and_grads(build(tiny_llama, True, **fields))
    model = build(tiny_llama, True, compile=True, compile_scope=scope, **fields)
    loss_c, grads_c = loss_and_grads(model)
    assert loss_c == pytest.approx(loss_e, rel=1e-6)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (1, 5)))  # eager: no compile for eval shapes


def saved_for_backward(model: Any) -> int:
    """Bytes one training forward keeps for backward, beyond the model's own tensors."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 96, (1, 24))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_sum(model, ids, torch.ones_like(ids), ids)
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("scope", ["layers", "decoder"])
def test_compiled_decoder_keeps_no_dequantised_weight_for_backward(
    tiny_llama: Path, scope: str
) -> None:
    """The decoder compiled without checkpointing (gradient_checkpointing auto's choice
    where memory allows) saves no more than eager: with AOT autograd's CSE on, the whole
    decoder's forward and backward nf4 dequantisations merged and every dequantised weight
    stayed alive until backward (8B on an H200: 25.7 GiB, not 7.9)."""
    fields = {"quantization": "nf4", "lora": {"dropout": 0.0}}
    eager = saved_for_backward(build(tiny_llama, True, **fields))
    model = build(tiny_llama, True, compile=True, compile_scope=scope, **fields)
    saved_for_backward(model)  # compiles
    assert saved_for_backward(model) <= eager


def test_compile_auto_needs_cuda_and_a_compiler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compile=auto compiles on CUDA with a compiler on PATH only (checkpointed or not);
    compile=true without a compiler is refused with what to change, not a Triton stack
    trace at the first step."""

    def use(compile: Any, device: str, checkpointing: bool = True) -> bool:
        config = RunConfig.model_validate(
            {
                "dataset": {"path": "unused.jsonl"},
                "compile": compile,
                "gradient_checkpointing": checkpointing,
            }
        )
        return use_compile(config, torch.device(device))

    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    assert use("auto", "cuda")
    assert use("auto", "cuda", checkpointing=False)
    assert not use("auto", "cpu")
    assert not use(False, "cuda")
    assert use(True, "cpu", checkpointing=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert not use("auto", "cuda")
    with pytest.raises(ConfigError) as err:
        use(True, "cuda")
    assert "gcc" in err.value.message
    assert "compile=false" in err.value.hint
