"""The LoRA linear layer as one autograd node: y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ.

peft builds and saves the adapters; this module only replaces the forward of each
plain LoRA layer (frozen base, nf4 or dense) while training with one active adapter.
Why: at small batches a GPU step is bound by the host, not the GPU, and peft +
bitsandbytes issue many Python-level ops per linear (module calls, a defensive clone, a
separate scale and add; bench/trainer/README.md has the counts). Here:

- forward: x·Aᵀ, its scaled product with Bᵀ, then W (nf4) dequantised once and x·Wᵀ
  accumulated onto it in place (cuBLAS beta=1); nothing of W is kept for backward;
- backward: dequantise W again (never stored: 16 GB of bf16 for an 8B model), the
  scale is applied to the rank-r tensors only;
- LoRA weights stay fp32 (the optimizer's copy) and are cast to the input's dtype
  inside, so autocast does not see them; their gradients come back fp32.

Any other state (merged weights, disabled adapters, several active adapters, DoRA,
a LoRA bias, peft's extra forward kwargs) falls back to peft's own forward, so
evaluation, merging and saving behave as before. Same code on CPU and CUDA.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# (packed weight, absmax, nested absmax, nested code, nested offset) and
# (blocksize, quant type, shape, dtype, nested blocksize), read once per layer
QuantTensors = tuple[torch.Tensor, torch.Tensor, Any, Any, Any]
QuantMeta = tuple[int, str, list[int], torch.dtype, int]


def quant_parts(base: torch.nn.Module) -> tuple[QuantTensors, QuantMeta] | None:
    """The nf4/fp4 state of `base.weight` as tensors + constants; None if not quantized."""
    qs = getattr(base.weight, "quant_state", None)
    if qs is None:
        return None
    nested = (qs.state2.absmax, qs.state2.code, qs.offset) if qs.nested else (None, None, None)
    nested_blocksize = qs.state2.blocksize if qs.nested else 0
    meta = (qs.blocksize, qs.quant_type, list(qs.shape), qs.dtype, nested_blocksize)
    return (base.weight.data, qs.absmax, *nested), meta


def dense_weight(
    weight: torch.Tensor | None,
    quant: QuantTensors | None,
    meta: QuantMeta | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The base weight [out, in] in `dtype`: `weight` if dense, else dequantised from
    `quant` (the two bitsandbytes ops that bitsandbytes.functional.dequantize_4bit runs)."""
    if quant is None or meta is None:
        assert weight is not None
        return weight.to(dtype)
    packed, absmax, nested_absmax, nested_code, offset = quant
    blocksize, quant_type, shape, qdtype, nested_blocksize = meta
    if nested_absmax is not None:
        absmax = (
            torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax, nested_absmax, nested_code, nested_blocksize, torch.float32
            )
            + offset
        )
    out = torch.ops.bitsandbytes.dequantize_4bit.default(
        packed, absmax, blocksize, quant_type, shape, qdtype
    )
    return out.to(dtype)


def _frozen(weight: Any, quant: QuantTensors | None) -> tuple[Any, ...]:
    """The frozen weight's tensors as the ops take them (absent ones None)."""
    return (weight, *(quant or (None,) * 5))


def _meta_args(meta: QuantMeta | None) -> tuple[int, str, list[int], torch.dtype, int]:
    return meta or (0, "", [], torch.bfloat16, 0)


def _weight(
    dtype: torch.dtype,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    absmax: torch.Tensor | None,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    offset: torch.Tensor | None,
    blocksize: int,
    quant_type: str,
    shape: list[int],
    qdtype: torch.dtype,
    nested_blocksize: int,
) -> torch.Tensor:
    """The base weight in `dtype`: `weight` itself, or dequantised from its 4-bit parts
    (the ops' schema order: the tensors, then the quantisation's metadata)."""
    if packed is None:
        return dense_weight(weight, None, None, dtype)
    assert absmax is not None
    quant = (packed, absmax, nested_absmax, nested_code, offset)
    return dense_weight(
        None, quant, (blocksize, quant_type, shape, qdtype, nested_blocksize), dtype
    )


# The two halves of the layer as opaque ops: inside a compiled graph each stays one
# call, so the rank-r product is written first and the big matmul accumulates onto it
# in place (cuBLAS beta=1). Traced as plain aten ops instead, the in-place add became an
# out-of-place addmm that copied every output once more. Defined with torch.library's
# Library, not custom_op: custom_op's Python wrappers (autograd and aliasing checks,
# redispatch) cost the host more per call, and the ops are called hundreds of times a
# step; eager code calls the functions themselves (bench/trainer/README.md: the costs).
_LIB = torch.library.Library("lorastack", "DEF")  # kept: the ops live as long as it
_LIB.define(
    "lora_linear_fwd(Tensor x2, Tensor xd2, Tensor a, Tensor b, float scale, Tensor? weight, "
    "Tensor? packed, Tensor? absmax, Tensor? nested_absmax, Tensor? nested_code, "
    "Tensor? offset, SymInt blocksize, str quant_type, SymInt[] shape, ScalarType qdtype, "
    "SymInt nested_blocksize) -> (Tensor, Tensor)"
)
_LIB.define(
    "lora_linear_bwd(Tensor dy2, Tensor xd2, Tensor xa, Tensor a, Tensor b, float scale, "
    "bool same_input, Tensor? weight, Tensor? packed, Tensor? absmax, Tensor? nested_absmax, "
    "Tensor? nested_code, Tensor? offset, SymInt blocksize, str quant_type, SymInt[] shape, "
    "ScalarType qdtype, SymInt nested_blocksize) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _fwd(
    x2: torch.Tensor,
    xd2: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    *frozen_weight: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x·Wᵀ + s·(xd·Aᵀ)·Bᵀ and xd·Aᵀ (kept for backward), for 2-D x and xd.
    `frozen_weight`: the base weight's arguments as _weight takes them after its dtype."""
    xa = xd2 @ a.t()  # [tokens, r]
    y = (xa * scale) @ b.t()
    w = _weight(x2.dtype, *frozen_weight)
    y.addmm_(x2, w.t())
    return y, xa


def _fwd_fake(x2, xd2, a, b, scale, weight, packed, *rest):
    out = b.shape[0]
    return x2.new_empty((x2.shape[0], out)), xd2.new_empty((xd2.shape[0], a.shape[0]))


def _bwd(
    dy2: torch.Tensor,
    xd2: torch.Tensor,
    xa: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    same_input: bool,
    *frozen_weight: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, d(xd) (empty when x itself was the LoRA input: then it is in dx), dA, dB.
    `frozen_weight`: as _fwd's."""
    g = (dy2 @ b) * scale  # [tokens, r]: dL/d(x_dropped·Aᵀ)
    w = _weight(dy2.dtype, *frozen_weight)
    # dx also where the input needs none (first layer, 1/32 of the work): no branch on
    # needs_input_grad, so one compiled graph serves every layer
    if same_input:
        dx = g @ a
        dx.addmm_(dy2, w)
        dxd = dx.new_empty(0)
    else:
        dx = dy2 @ w
        dxd = g @ a
    da = (g.t() @ xd2).float()
    db = (dy2.t() @ xa).mul_(scale).float()
    return dx, dxd, da, db


def _bwd_fake(dy2, xd2, xa, a, b, scale, same_input, *rest):
    dx = dy2.new_empty((dy2.shape[0], a.shape[1]))
    dxd = dx.new_empty(0) if same_input else dx.new_empty(dx.shape)
    return (
        dx,
        dxd,
        a.new_empty(a.shape, dtype=torch.float32),
        b.new_empty(b.shape, dtype=torch.float32),
    )


for _name, _impl, _fake in (
    ("lora_linear_fwd", _fwd, _fwd_fake),
    ("lora_linear_bwd", _bwd, _bwd_fake),
):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lorastack::{_name}", _fake, lib=_LIB)


def lora_linear_fwd(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """_fwd: the opaque op while torch.compile traces, the function itself in eager."""
    if torch.compiler.is_compiling():
        return torch.ops.lorastack.lora_linear_fwd.default(*args)
    return _fwd(*args)


def lora_linear_bwd(*args: Any) -> tuple[torch.Tensor, ...]:
    """_bwd: the opaque op while torch.compile traces, the function itself in eager."""
    if torch.compiler.is_compiling():
        return torch.ops.lorastack.lora_linear_bwd.default(*args)
    return _bwd(*args)


class LoraLinearFunction(torch.autograd.Function):
    """Autograd of the frozen-base LoRA linear; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        x_dropped: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        quant: QuantTensors | None,
        meta: QuantMeta | None,
    ) -> torch.Tensor:
        """The frozen linear plus the scaled LoRA product; saves what backward needs."""
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xd2 = x2 if x_dropped is None else x_dropped.reshape(-1, x.shape[-1])
        a = lora_a.to(dtype)
        b = lora_b.to(dtype)
        frozen = _frozen(weight, quant)
        y, xa = lora_linear_fwd(x2, xd2, a, b, scale, *frozen, *_meta_args(meta))
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.present = tuple(t is not None for t in frozen)  # save_for_backward gets no None
        ctx.save_for_backward(xd2, xa, a, b, *(t for t in frozen if t is not None))
        ctx.scale, ctx.meta = scale, meta
        ctx.same_input = x_dropped is None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        """Gradients of x, the dropped x, lora_a and lora_b (None for the rest)."""
        xd2, xa, a, b, *kept = ctx.saved_tensors
        found = iter(kept)
        frozen = tuple(next(found) if p else None for p in ctx.present)
        dy2 = dy.reshape(-1, dy.shape[-1]).to(xa.dtype)
        dx, dxd, da, db = lora_linear_bwd(
            dy2, xd2, xa, a, b, ctx.scale, ctx.same_input, *frozen, *_meta_args(ctx.meta)
        )
        dx = dx.reshape(*dy.shape[:-1], dx.shape[-1])
        dxd_out = None if ctx.same_input else dxd.reshape(*dy.shape[:-1], a.shape[-1])
        return dx, dxd_out, da, db, None, None, None, None, None


def _fast_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Forward of a peft LoRA layer; the fused path when the layer is in its plain state."""
    active = [a for a in self.active_adapters if a in self.lora_A]
    if (
        args
        or kwargs
        or self.disable_adapters
        or self.merged
        or len(active) != 1
        or active[0] in self.lora_variant
        or self.lora_B[active[0]].bias is not None
    ):
        return self._peft_forward(x, *args, **kwargs)
    name = active[0]
    dropout = self.lora_dropout[name]
    # None, not x itself, when no dropout applies: torch.compile (2.11) merges a tensor
    # passed twice into one input and kept only the second one's gradient (None here)
    x_dropped = dropout(x) if isinstance(dropout, torch.nn.Dropout) and self.training else None
    quant, meta = self._fused_quant or (None, None)
    out: torch.Tensor = LoraLinearFunction.apply(
        x,
        x_dropped,
        self.lora_A[name].weight,
        self.lora_B[name].weight,
        float(self.scaling[name]),
        None if quant else self.base_layer.weight,
        self.base_layer.bias,
        quant,
        meta,
    )
    return out


def install(model: torch.nn.Module) -> int:
    """Route every plain peft LoRA linear of `model` through the fused path; returns how
    many layers were routed (0 when peft built no such layer)."""
    from peft.tuners.lora import Linear as LoraLinear

    count = 0
    linear4bit: tuple[type, ...] = ()
    try:
        from peft.tuners.lora.bnb import Linear4bit

        linear4bit = (Linear4bit,)
    except ImportError:  # bitsandbytes absent: plain LoRA only
        pass
    layer: Any
    for layer in model.modules():
        if type(layer) in (LoraLinear, *linear4bit) and not hasattr(layer, "_peft_forward"):
            layer._peft_forward = layer.forward
            layer._fused_quant = quant_parts(layer.base_layer)
            layer.forward = types.MethodType(_fast_forward, layer)
            count += 1
    return count


__all__ = ["LoraLinearFunction", "dense_weight", "install", "quant_parts"]
