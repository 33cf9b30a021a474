"""What one training forward keeps for backward on CUDA, per trainer path: the tensors
a compiled graph saves, grouped by shape and dtype, with the step's speed and peak.

It found why the whole-decoder graph (compile_scope=decoder) peaked at 12.7 GiB on the
8B shape where compiled layers peak at 7.9: AOT autograd's partitioner saved each
layer's gate/up, q/o-sized and k/v matmul outputs instead of recomputing them inside
the checkpointed layers; activation_memory_budget=0.5 halves that at the same speed.

  PYTHONPATH=libs/lorastack/src:services/trainer/src python3 bench/trainer/trainer_gpu_saved.py \
      --baseline shared/bench/hf_peft_baseline.py --shape 1b

Prints one JSON line per path (needs CUDA, bitsandbytes; the baseline script writes the
random-weight model of the shape first).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_paths

# (label, trainer config fields, trainer.model.compiling.DECODER_ACTIVATION_BUDGET)
VARIANTS: list[tuple[str, dict[str, Any], float]] = [
    ("eager, checkpointing", {"compile": False}, 0.5),
    ("compile_scope=decoder, checkpointing, budget 1.0", {"compile_scope": "decoder"}, 1.0),
    ("compile_scope=decoder, checkpointing, budget 0.5", {"compile_scope": "decoder"}, 0.5),
]


def saved(model: Any, vocab: int, seq: int) -> dict[str, Any]:
    """Bytes one forward saves for backward beyond the model's own tensors, by shape."""
    from trainer.model.modeling import loss_sum

    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[str, str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = (str(tuple(t.shape)), str(t.dtype), t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, vocab, (1, seq), device=model_paths.DEVICE)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_sum(model, ids, torch.ones_like(ids), ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    size: collections.Counter[tuple[str, str]] = collections.Counter()
    for shape, dtype, n in seen.values():
        count[shape, dtype] += 1
        size[shape, dtype] += n
    top = size.most_common(12)
    return {
        "total_mib": round(sum(size.values()) / 2**20, 1),
        "largest": [[s, d, count[s, d], round(n / 2**20, 1)] for (s, d), n in top],
    }


def main() -> int:
    from unittest import mock

    import torch._dynamo

    import trainer.model.compiling

    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="path of hf_peft_baseline.py")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    model_paths.baseline(args.baseline, args.shape, args.seq, 1)
    config = json.loads(Path(f"/tmp/rand-{args.shape}/config.json").read_text())
    for label, fields, budget in VARIANTS:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        start = time.time()
        with mock.patch.object(trainer.model.compiling, "DECODER_ACTIVATION_BUDGET", budget):
            model = model_paths.load(args.shape, args.seq, **fields)
            row = model_paths.steps(model, 1, args.seq, config["vocab_size"], 8)
            row.pop("losses")
            row["saved"] = saved(model, config["vocab_size"], args.seq)
        print(json.dumps({"path": label, "wall_s": round(time.time() - start), **row}))
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
