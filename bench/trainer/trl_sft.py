"""The peer a user would pick: TRL's SFTTrainer with peft QLoRA (nf4, double quant, bf16
compute), on lorastack's chat JSONL, from the model folder to a saved adapter.

Trains on the assistant turn only (prompt-completion format, TRL's completion-only
loss), as `lorastack train` does. Prints one JSON object: wall seconds from start to the
saved adapter, set-up seconds, optimizer steps, non-padding and supervised tokens and
their rates, peak allocated/reserved GiB, the loss per step.

usage (CUDA machine with trl, peft, bitsandbytes; liger-kernel for --liger):
  python3 bench/trainer/trl_sft.py --model DIR --data CHATS.jsonl --out DIR \
      --steps 150 --micro-batch 2 --grad-accum 2 --max-length 2048 [--packing bfd] [--liger]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

START = time.monotonic()


def main() -> int:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--packing", choices=["none", "bfd", "wrapped"], default="none")
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    args = ap.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line]
    data = Dataset.from_list(
        [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
        device_map={"": 0},
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    packing = args.packing != "none"
    config = SFTConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=True,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_length=args.max_length,
        packing=packing,
        **({"packing_strategy": args.packing} if packing else {}),
        use_liger_kernel=args.liger,
        completion_only_loss=True,
        dataset_num_proc=8,
        seed=0,
    )
    counted = {"tokens": 0, "supervised": 0}
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            lora_dropout=0.0,
            target_modules=targets,
            task_type="CAUSAL_LM",
        ),
    )
    collate = trainer.data_collator

    def counting(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate(features)
        mask = batch.get("attention_mask")
        counted["tokens"] += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        counted["supervised"] += int((batch["labels"][:, 1:] != -100).sum())
        return batch

    trainer.data_collator = counting
    setup_s = time.monotonic() - START
    torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    trainer.save_model(str(Path(args.out) / "adapter"))
    wall = time.monotonic() - START
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        json.dumps(
            {
                "arm": f"trl packing={args.packing} liger={args.liger}",
                "wall_s": round(wall, 1),
                "setup_s": round(setup_s, 1),
                "train_s": round(train_s, 1),
                "steps": trainer.state.global_step,
                "tokens": counted["tokens"],
                "supervised_tokens": counted["supervised"],
                "tokens_per_s_wall": round(counted["tokens"] / wall, 1),
                "tokens_per_s_train": round(counted["tokens"] / train_s, 1),
                "supervised_per_s_wall": round(counted["supervised"] / wall, 1),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
                "losses": losses,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
