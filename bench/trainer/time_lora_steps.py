"""Time the demo LoRA job's optimizer steps on a GPU, for `lorastack cost estimate`.

Same shapes as services/trainer/src/trainer/configs/demo.yaml: SmolLM2-135M (config only: random
weights, the step time does not depend on their values), LoRA r=8 alpha=16 on all linear
layers, micro-batch 4 x grad-accum 2, AdamW; sequences of SEQ tokens. Writes
metrics-step-N.json files ({"step", "step_time_s"}) like the trainer, into OUT/metrics.

    python3 time_lora_steps.py CONFIG.json OUT_DIR STEPS DTYPE(float32|bfloat16) [SEQ]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    cfg_path, out, steps, dtype = (
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    seq = int(sys.argv[5]) if len(sys.argv) > 5 else 80  # tokens per sample (demo: ~60-90)
    torch.manual_seed(0)
    config = LlamaConfig.from_dict(json.loads(cfg_path.read_text()))
    model = LlamaForCausalLM(config).to("cuda", dtype=getattr(torch, dtype))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))  # fmt: skip
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    micro, accum = 4, 2
    for step in range(1, steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(3, config.vocab_size, (micro, seq), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rec = {
            "step": step,
            "step_time_s": dt,
            "loss": loss.item() * accum,
            "dtype": dtype,
            "seq": seq,
        }
        (out / "metrics" / f"metrics-step-{step}.json").write_text(json.dumps(rec))
    times = [
        json.loads((out / "metrics" / f"metrics-step-{s}.json").read_text())["step_time_s"]
        for s in range(6, steps + 1)
    ]
    print(dtype, torch.cuda.get_device_name(), f"mean s/step after 5 warm-up steps: {sum(times) / len(times):.4f}",
          f"min {min(times):.4f} max {max(times):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
