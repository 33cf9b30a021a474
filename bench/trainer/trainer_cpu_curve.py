"""Loss curves on real text: the trainer's model path against the plain
transformers+peft path, through SmolLM2-135M-Instruct on the CPU.

Same chats (the demo task's written-date -> ISO-date conversations, assistant-only labels
from trainer.data.samples.encode), same batch order, same LoRA init (r=16 on all linear layers)
and the same AdamW steps with gradient clipping. The plain path is what a user writes
from the peft docs (prepare_model_for_kbit_training for nf4, peft's forward, full
logits, mean cross-entropy over supervised tokens); the trainer's path is
trainer.model.modeling.load_model + loss_sum (fused LoRA linear, chunked cross-entropy over
supervised positions only). Prints one JSON object with both curves.

usage (repo root, the HF folder of SmolLM2, e.g. the one `lorastack model import-default`
writes): .venv/bin/python bench/trainer/trainer_cpu_curve.py --base DIR [--steps 20]
    [--quantization none|nf4]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from model_paths import ALL_LINEAR, plain_loss_sum  # this folder: the GPU bench's plain path


def plain_model(base: Path, quantization: str, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if quantization == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        kwargs["device_map"] = {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    model.config.use_cache = False
    if quantization == "nf4":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(seed)  # as trainer.model.modeling.load_model: the same LoRA A init
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)


def curve(model: Any, loss_fn: Any, batches: list[dict[str, Any]]) -> tuple[list[float], float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    model.train()
    losses, start = [], time.perf_counter()
    for b in batches:
        n_sup = int((b["labels"][:, 1:] != -100).sum())
        loss = loss_fn(model, b["input_ids"], b["attention_mask"], b["labels"]) / n_sup
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 6))
    return losses, round((time.perf_counter() - start) / len(batches), 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, type=Path, help="HF folder of SmolLM2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", choices=["none", "nf4"], default="none")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from trainer.config import RunConfig
    from trainer.data.batching import collate, epoch_order
    from trainer.data.demo_data import make_demo
    from trainer.data.samples import encode, end_of_turn_id
    from trainer.model.modeling import load_model, loss_sum

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    samples = [encode(c, tokenizer, "all_assistant") for c in make_demo(200, args.seed)]
    if args.steps * args.batch > len(samples):
        sys.exit(f"--steps x --batch must be at most {len(samples)} (one epoch)")
    pad = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn_id(tokenizer)
    )
    order = epoch_order(args.seed, 0, len(samples))
    batches = [
        collate([samples[i] for i in order[s * args.batch : (s + 1) * args.batch]], pad)
        for s in range(args.steps)
    ]
    config = RunConfig.model_validate(
        {
            "dataset": {"path": "unused.jsonl"},
            "quantization": args.quantization,
            "device": "cpu",
            "seed": args.seed,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ALL_LINEAR},
        }
    )
    torch.manual_seed(args.seed)
    plain, plain_s = curve(
        plain_model(args.base, args.quantization, args.seed), plain_loss_sum, batches
    )
    torch.manual_seed(args.seed)
    ours, ours_s = curve(load_model(args.base, config, torch.device("cpu")), loss_sum, batches)
    rel = [abs(a - b) / abs(a) for a, b in zip(plain, ours, strict=True)]
    print(
        json.dumps(
            {
                "compare": "loss curve on real text, same chats, batches, seed and LoRA init",
                "model": "SmolLM2-135M-Instruct, fp32 compute, CPU",
                "quantization": args.quantization,
                "steps": args.steps,
                "batch": args.batch,
                "supervised_tokens": sum(int((b["labels"] != -100).sum()) for b in batches),
                "max_relative_difference": round(max(rel), 6),
                "final_relative_difference": round(rel[-1], 6),
                "step_s": {"plain": plain_s, "lorastack": ours_s},
                "plain": plain,
                "lorastack": ours,
                "torch": torch.__version__,
                "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
