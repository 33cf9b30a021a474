"""The baseline of bench/trainer/trainer_gpu.py (--baseline): plain transformers + peft
(+ bitsandbytes) LoRA/QLoRA step throughput and peak VRAM on a Llama-shaped model with
random weights.

Throughput and memory do not depend on the weights' values, so a random model of a
real shape is a fair stand-in for the pretrained one. This is the path a user
would take from the HF/PEFT tutorials; it is the baseline the project must beat.

usage: python hf_peft_baseline.py SHAPE MODE [SEQ] [BATCH]
  SHAPE: 1b | 8b     MODE: lora | qlora
"""

import json
import os
import sys
import time

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}


def main():
    shape, mode = sys.argv[1], sys.argv[2]
    seq = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    path = f"/tmp/rand-{shape}"
    if not os.path.exists(path + "/config.json"):
        with torch.device("cuda"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(path)
        del m
        torch.cuda.empty_cache()
    kw = dict(dtype=torch.bfloat16, device_map={"": 0}, attn_implementation="sdpa")
    if mode == "qlora":
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    if mode == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    lcfg = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    model = get_peft_model(model, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _step in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = sorted(times[3:])[len(times[3:]) // 2]
    out = dict(
        shape=shape,
        mode=mode,
        seq=seq,
        batch=batch,
        step_s_median=round(steady, 4),
        tokens_per_s=round(batch * seq / steady),
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
        trainable=sum(p.numel() for p in params),
        loss=float(loss),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
