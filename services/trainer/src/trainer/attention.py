"""How a decoder layer attends over packed rows: each sample on its own, at the cost of
its own length.

Packed rows (trainer.packing) hold several samples; with transformers' SDPA path a row
attends through a dense block-diagonal causal mask, so every row costs a full
max_seq_len x max_seq_len attention whatever its samples' lengths. On CUDA the run
loads its model with VARLEN instead: the rows are one variable-length batch of samples
(`cu_seq_lens`, the samples' offsets, which trainer.packing collates) for
FlashAttention's variable-length kernel, which computes only within each sample. On
the long-tailed chat mix (bench/trainer/chat_mix.py) that is a third of the dense
work: an attention forward and backward of 4 rows x 2,048 tokens at the 8B widths took
2.3 ms against SDPA's 3.9 ms on an H200 (bench/trainer/results/).

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
    model attends with VARLEN, none otherwise."""
    if cu is None or getattr(model.config, "_attn_implementation", None) != VARLEN:
        return {}
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": width, "max_length_k": width}


__all__ = ["VARLEN", "model_kwargs", "register", "use_varlen", "varlen_attention"]
