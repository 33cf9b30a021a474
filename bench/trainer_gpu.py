"""GPU benchmark: the plain transformers+peft+bitsandbytes QLoRA baseline and the
lorastack trainer's model path, measured in one run on the same machine.

Random weights of real shapes (Llama-3.1-8B, Llama-3.2-1B): throughput and memory do
not depend on weight values. The baseline is shared/bench/hf_peft_baseline.py, run as
its own process (it also writes the random model both sides load). The trainer side
calls trainer.modeling.load_model and loss_sum, the functions `lorastack train` uses.
Prints one JSON object per measurement and a summary line.

usage (on a CUDA machine, repo root):
  PYTHONPATH=libs/lorastack/src:services/trainer/src python3 bench/trainer_gpu.py \
      --baseline PATH/hf_peft_baseline.py [--shapes 8b,1b] [--steps 12]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_config(
    batch: int, seq: int, checkpointing: bool, fused: bool = True, compile: bool = False
) -> Any:
    from trainer.config import RunConfig

    return RunConfig.model_validate(
        {
            "dataset": {"path": "unused.jsonl"},
            "quantization": "nf4",
            "max_seq_len": seq,
            "micro_batch": batch,
            "gradient_checkpointing": checkpointing,
            "fused_lora": fused,
            "compile": compile,
            "device": "cuda",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ALL_LINEAR},
        }
    )


def baseline(script: str, shape: str, seq: int, batch: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, script, shape, "qlora", str(seq), str(batch)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        oom = "OutOfMemoryError" in out.stderr
        return {"error": "OOM" if oom else out.stderr[-600:]}
    return dict(json.loads(lines[-1]))


def plain_loss_sum(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """The plain path's loss: full logits, upcast to fp32."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
    )


def steps(
    model: Any, batch: int, seq: int, vocab: int, n: int, loss_fn: Any = None
) -> dict[str, Any]:
    """Timed optimizer steps on random tokens (all positions supervised)."""
    from trainer.modeling import loss_sum

    loss_fn = loss_fn or loss_sum
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = loss_fn(model, ids, mask, ids) / (batch * (seq - 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(float(loss), 5))
    steady = sorted(times[3:])[len(times[3:]) // 2]
    return {
        "batch": batch,
        "seq": seq,
        "step_s_median": round(steady, 4),
        "tokens_per_s": round(batch * seq / steady),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "losses": losses,
    }


# (label, fused_lora, compile): the trainer's default path, the same with peft's own LoRA
# forward (to attribute the fused layer's gain), and with compile=true
PATHS = [
    ("lorastack, peft forward", False, False),
    ("lorastack", True, False),
    ("lorastack, compile", True, True),
]
# (gradient checkpointing, batch) measured on each path
PLAN = {
    "lorastack, peft forward": [(True, 1)],
    "lorastack": [(True, 1), (False, 1), (True, 4)],
    "lorastack, compile": [(True, 1), (False, 1), (True, 4)],
}


def set_checkpointing(model: Any, on: bool) -> None:
    """Per-layer switch of the (non-reentrant) checkpointing that load_model enabled."""
    for layer in model.get_base_model().get_decoder().layers:
        layer.gradient_checkpointing = on


def load(shape: str, seq: int, fused: bool, compile: bool = False) -> Any:
    from trainer.modeling import load_model

    gc.collect()
    torch.cuda.empty_cache()
    config = run_config(1, seq, True, fused, compile)
    model = load_model(Path(f"/tmp/rand-{shape}"), config, torch.device("cuda", 0))
    model.train()
    return model


def trainer_side(shape: str, seq: int, n: int) -> list[dict[str, Any]]:
    vocab = json.loads(Path(f"/tmp/rand-{shape}/config.json").read_text())["vocab_size"]
    results = []
    for label, fused, compile in PATHS:
        model = load(shape, seq, fused, compile)
        for ckpt, batch in PLAN[label]:
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


def gradient_check(shape: str, seq: int) -> dict[str, Any]:
    """One step's LoRA gradients through compiled vs eager layers: same model, data and
    weights (compiled layers run in training mode only, eager ones in eval mode)."""
    from trainer.modeling import loss_sum

    model = load(shape, seq, True, True)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make every gradient non-trivial
            p.data.normal_(0, 0.01)
    set_checkpointing(model, False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), device="cuda", generator=gen)
    grads = []
    for training in (False, True):
        for layer in model.get_base_model().get_decoder().layers:
            layer.train(training)
        loss = loss_sum(model, ids, torch.ones_like(ids), ids) / (seq - 1)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        model.zero_grad(set_to_none=True)
    eager, compiled = grads
    rel = sorted(float((compiled[k] - g).norm() / g.norm()) for k, g in eager.items())
    del model
    return {
        "shape": shape,
        "compare": "LoRA gradients of one step, compiled vs eager layers (|dg| / |g| per tensor)",
        "tensors": len(rel),
        "median": round(rel[len(rel) // 2], 5),
        "max": round(rel[-1], 5),
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


def same_curve(shape: str, seq: int, n: int) -> dict[str, Any]:
    """Loss curves of the plain path and the trainer's path on the same data and seed."""
    vocab = json.loads(Path(f"/tmp/rand-{shape}/config.json").read_text())["vocab_size"]
    curves = {}
    for side in ("plain", "lorastack"):
        torch.cuda.empty_cache()
        if side == "plain":
            model = plain_model(shape)
            curves[side] = steps(model, 1, seq, vocab, n, plain_loss_sum)["losses"]
        else:
            model = load(shape, seq, True)
            set_checkpointing(model, False)
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
        "max_relative_difference": round(max(diffs), 5),
        **curves,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="path of hf_peft_baseline.py")
    ap.add_argument("--shapes", default="8b,1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
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
    summary = []
    for shape in args.shapes.split(","):
        base = {b: baseline(args.baseline, shape, args.seq, b) for b in (1, 2)}
        for b, r in base.items():
            print(json.dumps({"shape": shape, "side": "baseline", "batch": b, **r}), flush=True)
        ours = trainer_side(shape, args.seq, args.steps)
        print(json.dumps(gradient_check(shape, args.seq)), flush=True)
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
    curve = same_curve(args.shapes.split(",")[-1], args.seq, 20)
    print(json.dumps(curve), flush=True)
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
