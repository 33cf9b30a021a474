"""The LoRA linear layer as one autograd node: y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ.

peft builds and saves the adapters; this module only replaces the forward of each
plain LoRA layer (frozen base, nf4 or dense) while training with one active adapter.
Why (bench/trainer/results/): at batch 1 on an H200 the step was bound by the
host, not the GPU: peft + bitsandbytes issue ~15 Python-level ops per linear (module
calls, a defensive clone, a separate scale and add), 224 linears per 8B forward. Here:

- forward: dequantise W (nf4) once, x·Wᵀ, x·Aᵀ, and the LoRA product added in place
  with its scale (one addmm); nothing of W is kept for backward;
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
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xd2 = x2 if x_dropped is None else x_dropped.reshape(-1, x.shape[-1])
        a = lora_a.to(dtype)
        b = lora_b.to(dtype)
        y = x2 @ dense_weight(weight, quant, meta, dtype).t()
        xa = xd2 @ a.t()  # [tokens, r]
        y.addmm_(xa, b.t(), alpha=scale)
        if bias is not None:
            y += bias.to(dtype)
        frozen = (weight,) if quant is None else quant
        ctx.present = tuple(t is not None for t in frozen)  # save_for_backward gets no None
        ctx.save_for_backward(xd2, xa, a, b, *(t for t in frozen if t is not None))
        ctx.scale, ctx.meta = scale, meta
        ctx.same_input = x_dropped is None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        xd2, xa, a, b, *kept = ctx.saved_tensors
        found = iter(kept)
        frozen = tuple(next(found) if p else None for p in ctx.present)
        dy2 = dy.reshape(-1, dy.shape[-1]).to(xa.dtype)
        g = (dy2 @ b) * ctx.scale  # [tokens, r]: dL/d(x_dropped·Aᵀ)
        weight, quant = (frozen[0], None) if ctx.meta is None else (None, frozen)
        # dx also where the input needs none (first layer, 1/32 of the work): no branch on
        # needs_input_grad, so one compiled graph serves every layer
        dx = dy2 @ dense_weight(weight, quant, ctx.meta, dy2.dtype)  # type: ignore[arg-type]
        dxd = None
        if ctx.same_input:
            dx.addmm_(g, a)
        else:
            dxd = (g @ a).reshape(*dy.shape[:-1], a.shape[-1])
        dx = dx.reshape(*dy.shape[:-1], dx.shape[-1])
        da = (g.t() @ xd2).float()
        db = (dy2.t() @ xa).mul_(ctx.scale).float()
        return dx, dxd, da, db, None, None, None, None, None


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
