"""GPU benchmark: the plain transformers+peft+bitsandbytes QLoRA baseline and the
lorastack trainer's model path, measured in one run on the same machine.

Random weights of real shapes (Llama-3.1-8B, Llama-3.2-1B): throughput and memory do
not depend on weight values. The baseline is shared/bench/hf_peft_baseline.py, run as
its own process (it also writes the random model both sides load). The trainer side
calls trainer.model.modeling.load_model and loss_sum, the functions `lorastack train` uses.
Prints one JSON object per measurement and a summary line. The model paths, the baseline's
process and the timed steps are model_paths.py's, beside this script.

usage (on a CUDA machine, repo root):
  PYTHONPATH=libs/lorastack/src:services/trainer/src python3 bench/trainer/trainer_gpu.py \
      --baseline PATH/hf_peft_baseline.py [--shapes 8b,1b] [--steps 12] [--quick]
The whole-decoder path compiles for minutes: under a 10-minute limit, run one shape per
call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_paths import (
    ALL_LINEAR,
    DEVICE,
    baseline,
    load,
    plain_loss_sum,
    set_checkpointing,
    steps,
)

# (label, config fields): eager with peft's own LoRA forward (to attribute the fused
# layer's gain), eager (compile=false), compiled decoder layers, the trainer's default on
# CUDA (compile=auto with checkpointing: the whole decoder as one graph), and compiled
# layers without checkpointing (why auto leaves that case eager: memory)
DEFAULT = "lorastack, compile_scope=decoder"
PATHS: list[tuple[str, dict[str, Any]]] = [
    ("lorastack, eager, peft forward", {"fused_lora": False, "compile": False}),
    ("lorastack, eager", {"compile": False}),
    ("lorastack, compile_scope=layers", {"compile_scope": "layers"}),
    (DEFAULT, {"compile_scope": "decoder"}),
    ("lorastack, compile=true", {"compile": True, "compile_scope": "layers"}),
]
# (gradient checkpointing, batch) measured on each path; --quick keeps the first of each
# but the default's
PLAN = {
    "lorastack, eager, peft forward": [(True, 1)],
    "lorastack, eager": [(True, 1), (False, 1), (True, 4)],
    "lorastack, compile_scope=layers": [(True, 1), (True, 4)],
    DEFAULT: [(True, 1), (True, 4)],
    "lorastack, compile=true": [(False, 1)],
}


def trainer_side(
    shape: str, seq: int, n: int, quick: bool, only: list[str] | None = None
) -> list[dict[str, Any]]:
    vocab = json.loads(Path(f"/tmp/rand-{shape}/config.json").read_text())["vocab_size"]
    results = []
    paths = PATHS[1:] if quick else PATHS
    for label, fields in [p for p in paths if only is None or p[0] in only]:
        model = load(shape, seq, **fields)
        plan = PLAN[label]
        if quick:
            plan = plan if label == DEFAULT else plan[:1]
        for ckpt, batch in plan:
            set_checkpointing(model, ckpt)
            try:
                r = steps(model, batch, seq, vocab, n)
            except torch.OutOfMemoryError:
                r = {"batch": batch, "seq": seq, "error": "OOM"}
            torch.cuda.empty_cache()
            row = {"shape": shape, "side": label, "gradient_checkpointing": ckpt, **r}
            results.append(row)
            print(json.dumps(row), flush=True)
        del model
    return results


def lora_grads(model: Any, ids: Any) -> dict[str, Any]:
    from trainer.model.modeling import loss_sum

    loss = loss_sum(model, ids, torch.ones_like(ids), ids) / (ids.numel() - 1)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def gradient_check(shape: str, seq: int) -> dict[str, Any]:
    """One step's LoRA gradients, bf16 compiled layers and bf16 eager ones, each against an
    fp32 eager reference: same nf4 weights, LoRA weights and tokens. Compiled is right when
    it lands as close to fp32 as eager does (a deep random-weight model amplifies bf16
    rounding, so compiled vs eager alone cannot tell a bug from rounding)."""
    from unittest import mock

    import trainer.model.modeling

    def prepared(model: Any) -> Any:
        set_checkpointing(model, False)
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: make every gradient non-trivial
                p.data.normal_(0, 0.01)
        return model

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    ids = torch.randint(0, 1000, (1, seq), device=DEVICE, generator=gen)
    with mock.patch.object(trainer.model.modeling, "compute_dtype", lambda d: torch.float32):
        model = prepared(load(shape, seq, compile=False))
    grads = {"fp32 eager": lora_grads(model, ids)}
    del model
    model = prepared(load(shape, seq, compile_scope="layers"))
    for label, training in (("bf16 eager", False), ("bf16 compiled", True)):
        model.get_base_model().get_decoder().train(training)  # compiled: training mode
        grads[label] = lora_grads(model, ids)
    del model

    def rel(a: str, b: str) -> dict[str, float]:
        r = sorted(float((grads[a][k] - g).norm() / g.norm()) for k, g in grads[b].items())
        return {"median": round(r[len(r) // 2], 5), "max": round(r[-1], 5)}

    return {
        "shape": shape,
        "compare": "LoRA gradients of one step, |dg| / |g| per tensor",
        "tensors": len(grads["fp32 eager"]),
        "bf16 eager vs fp32 eager": rel("bf16 eager", "fp32 eager"),
        "bf16 compiled vs fp32 eager": rel("bf16 compiled", "fp32 eager"),
        "bf16 compiled vs bf16 eager": rel("bf16 compiled", "bf16 eager"),
    }


def varied_widths(shape: str) -> dict[str, Any]:
    """The trainer's batches change width from step to step (right-padded to the longest
    sample): per step, the compiled layers' loss against the eager layers' on the same
    batch, the step time, and how many graphs dynamo compiled in all."""
    from torch._dynamo.utils import counters

    from trainer.model.modeling import loss_sum

    before = dict(counters["stats"])
    model = load(shape, 2048, compile_scope="layers")
    set_checkpointing(model, True)
    decoder = model.get_base_model().get_decoder()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    rows = []
    for batch, width in [(1, 2048), (1, 1536), (4, 1024), (1, 700), (4, 2048), (2, 333), (1, 2048)]:
        ids = torch.randint(0, 1000, (batch, width), device=DEVICE, generator=gen)
        mask = torch.ones_like(ids)
        for i in range(1, batch):  # row 0 is the longest; the others end earlier
            mask[i, width - width * i // (batch + 1) :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        decoder.train(False)
        with torch.no_grad():
            eager = float(loss_sum(model, ids, mask, labels))
        decoder.train(True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = loss_sum(model, ids, mask, labels)
        loss.backward()
        torch.cuda.synchronize()
        rows.append(
            {
                "batch": batch,
                "width": width,
                "step_s": round(time.perf_counter() - t, 3),
                "loss_rel_diff": round(abs(float(loss.detach()) - eager) / eager, 5),
            }
        )
        model.zero_grad(set_to_none=True)
    del model
    return {
        "shape": shape,
        "compare": "compiled vs eager layers on batches of varying width (forward+backward)",
        "steps": rows,
        "dynamo_stats": {k: v - before.get(k, 0) for k, v in counters["stats"].items()},
    }


def plain_model(shape: str) -> Any:
    """The baseline's model path (prepare_model_for_kbit_training, full logits), seeded
    like the trainer's so both start from the same LoRA weights."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        f"/tmp/rand-{shape}", dtype=torch.bfloat16, device_map={"": 0}, quantization_config=q
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lcfg = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=ALL_LINEAR,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lcfg)


def same_curve(shape: str, seq: int, n: int, **fields: Any) -> dict[str, Any]:
    """Loss curves of the plain path and the trainer's path (config `fields`, checkpointing
    on with a compile scope, else off) on the same data and seed."""
    vocab = json.loads(Path(f"/tmp/rand-{shape}/config.json").read_text())["vocab_size"]
    curves: dict[str, Any] = {}
    for side in ("plain", "lorastack"):
        torch.cuda.empty_cache()
        if side == "plain":
            model = plain_model(shape)
            curves[side] = steps(model, 1, seq, vocab, n, plain_loss_sum)["losses"]
        else:
            model = load(shape, seq, **fields)
            set_checkpointing(model, "compile_scope" in fields)
            curves[side] = steps(model, 1, seq, vocab, n)["losses"]
        del model
    # a non-finite loss must show as a divergence: max() over NaNs answers anything
    diffs = [
        abs(a - b) / abs(a) if math.isfinite(b) else math.inf
        for a, b in zip(curves["plain"], curves["lorastack"], strict=True)
    ]
    return {
        "shape": shape,
        "compare": "loss curve, same data and seed",
        "steps": n,
        "trainer_fields": fields,
        "max_relative_difference": round(max(diffs), 5),
        **curves,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="path of hf_peft_baseline.py")
    ap.add_argument("--shapes", default="8b,1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="baseline at batch 1 only, no peft-forward path, the first plan row of each other "
        "path (both of the whole-decoder one), the gradient check; no varying widths, no loss "
        "curve",
    )
    ap.add_argument(
        "--paths", nargs="+", help="measure only these trainer paths (labels as in PATHS)"
    )
    ap.add_argument("--no-gradient-check", action="store_true")
    ap.add_argument(
        "--curve-only",
        metavar="JSON",
        help="only the loss-curve comparison on the last shape, the trainer with these config "
        'fields, e.g. \'{"compile_scope": "decoder"}\'',
    )
    args = ap.parse_args()
    import bitsandbytes
    import peft
    import transformers

    env = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }
    print(json.dumps({"environment": env}), flush=True)
    if args.curve_only:
        shape = args.shapes.split(",")[-1]
        baseline(args.baseline, shape, args.seq, 1)  # writes the random-weight model
        fields = json.loads(args.curve_only)
        print(json.dumps(same_curve(shape, args.seq, 20, **fields)), flush=True)
        return 0
    summary = []
    for shape in args.shapes.split(","):
        base = {
            b: baseline(args.baseline, shape, args.seq, b) for b in ((1,) if args.quick else (1, 2))
        }
        for b, r in base.items():
            print(json.dumps({"shape": shape, "side": "baseline", "batch": b, **r}), flush=True)
        ours = trainer_side(shape, args.seq, args.steps, args.quick, args.paths)
        if not args.no_gradient_check:
            print(json.dumps(gradient_check(shape, args.seq)), flush=True)
        if shape == "1b" and not args.quick:
            print(json.dumps(varied_widths(shape)), flush=True)
        b1 = base[1].get("tokens_per_s")
        for r in ours:
            if b1 and "tokens_per_s" in r:
                summary.append(
                    {
                        "shape": shape,
                        "side": r["side"],
                        "batch": r["batch"],
                        "gradient_checkpointing": r["gradient_checkpointing"],
                        "tokens_per_s": r["tokens_per_s"],
                        "speedup_vs_baseline_b1": round(r["tokens_per_s"] / b1, 2),
                        "peak_alloc_gib": r["peak_alloc_gib"],
                    }
                )
    if not args.quick:
        print(json.dumps(same_curve(args.shapes.split(",")[-1], args.seq, 20)), flush=True)
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
