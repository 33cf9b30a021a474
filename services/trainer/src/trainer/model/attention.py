"""How a decoder layer attends over packed rows: each sample on its own, at the cost of
its own length.

Packed rows (trainer.data.packing) hold several samples; with transformers' SDPA path a row
attends through a dense block-diagonal causal mask, so every row costs a full
max_seq_len x max_seq_len attention whatever its samples' lengths. On CUDA the run
loads its model with VARLEN instead: the rows are one variable-length batch of samples
(`cu_seq_lens`, the samples' offsets, which trainer.data.packing collates) for
FlashAttention's variable-length kernel, which computes only within each sample: on
long-tailed data a fraction of the dense work (bench/trainer/chat_mix.py; the timings
are in bench/trainer/README.md).

Anything else (evaluation and generation without `cu_seq_lens`, dropout on the
attention weights, sliding windows, soft-capping, attention sinks) goes to transformers'
own SDPA function with the mask transformers built, so results never depend on the
path. The CPU keeps SDPA (FlashAttention has no CPU kernel).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config import RunConfig

VARLEN = "lorastack_varlen"  # the name registered with transformers' attention interfaces
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # kwargs the varlen call cannot honour
# model settings under which a layer can pass one of those (or dropout) and fall back
_FALLBACK_CONFIG = (
    "sliding_window",
    "use_sliding_window",
    "attn_logit_softcapping",
    "attention_dropout",
)


def _may_fall_back(config: Any) -> bool:
    """Whether some layer of this model can pass _UNSUPPORTED kwargs or dropout."""
    if any(getattr(config, k, None) for k in _FALLBACK_CONFIG):
        return True
    return any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())


def use_varlen(config: RunConfig, device: torch.device, model_config: dict[str, Any]) -> bool:
    """Whether the run loads its model with VARLEN: packed rows on a CUDA device whose
    torch has FlashAttention (Ampere or newer), with a head size it supports."""
    if not config.packing or device.type != "cuda":
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    heads = model_config.get("num_attention_heads") or 1
    head_dim = model_config.get("head_dim") or model_config.get("hidden_size", 0) // heads
    return 0 < head_dim <= 256 and head_dim % 8 == 0


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, width: int, scale: float
) -> torch.Tensor:
    """Causal attention of each sample on its own: q [tokens, heads, d], k and v
    [tokens, kv heads, d] (grouped-query attention as is), `cu` the samples' offsets,
    `width` an upper bound of their lengths. Differentiable (aten's backward)."""
    out: torch.Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, width, width, 0.0, True, False, scale=scale
    )[0]
    return out


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [batch, heads, seq, d], key
    and value [batch, kv heads, seq, d]; returns [batch, seq, heads, d]."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or dropout or any(kwargs.get(k) is not None for k in _UNSUPPORTED):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is not None and attention_mask.numel() == 0:  # model_kwargs' stand-in
            raise RuntimeError("packed rows reached SDPA without their mask: " + str(kwargs))

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, seq, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    q = query.transpose(1, 2).reshape(batch * seq, heads, d)
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], d)
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], d)
    out = flash_varlen(q, k, v, cu, int(kwargs.get("max_length_q") or seq), scale)
    return out.view(batch, seq, heads, d), None


def register() -> None:
    """Make VARLEN a name transformers accepts (idempotent); its masks are SDPA's, for
    the calls that fall back."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, sdpa_mask)


def model_kwargs(model: Any, cu: torch.Tensor | None, width: int) -> dict[str, Any]:
    """The decoder's extra arguments for packed rows: their sample offsets where the
    model attends with VARLEN, none otherwise. Where no layer can fall back to SDPA, an
    empty 4-D attention_mask stands in for the block-diagonal mask that transformers
    would otherwise build from the position ids for nothing: its check for packed rows
    waits for the GPU, and the mask (seq x seq per row) is computed only to be ignored."""
    config = model.config
    if cu is None or getattr(config, "_attn_implementation", None) != VARLEN:
        return {}
    out: dict[str, Any] = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    out |= {"max_length_q": width, "max_length_k": width}
    if not _may_fall_back(config):
        out["attention_mask"] = cu.new_empty((0, 0, 0, 0), dtype=torch.bool)
    return out


__all__ = ["VARLEN", "model_kwargs", "register", "use_varlen", "varlen_attention"]
