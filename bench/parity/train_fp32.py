"""`lorastack train` with float32 compute on CUDA, for the issue-46 diagnosis only: the
trainer computes in bfloat16 on CUDA, and this run tells whether that precision is what
the GPU demo's answers lose. Patches the dtype choice and turns off the bf16-only
FlashAttention varlen path, then runs the trainer's own command.

    python bench/parity/train_fp32.py CONFIG [key=value ...]
"""

from __future__ import annotations

import sys

import torch

from trainer import assembly
from trainer.model import attention, modeling


def fp32(device: torch.device) -> torch.dtype:
    return torch.float32


modeling.compute_dtype = fp32  # type: ignore[assignment]
assembly.compute_dtype = fp32  # type: ignore[attr-defined]
attention.use_varlen = lambda *a, **k: False  # type: ignore[assignment]

if __name__ == "__main__":
    from lorastack.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
