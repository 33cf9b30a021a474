"""GPU probe: which torch.compile setups give the eager LoRA gradients on CUDA.

torch.compile of the decoder layers trained correctly on CPU (torch 2.13) but gave wrong
LoRA gradients on an H200 (torch 2.11; bench/results/trainer-gpu-2026-11-30-session2.md).
This prints, per setup, |g_compiled - g_eager| / |g_eager| over the LoRA tensors of one
step (same model, data and weights) and the compiled step time, on the Llama-3.2-1B shape.

usage (CUDA machine, repo root):
  PYTHONPATH=libs/lorastack/src:services/trainer/src:bench python3 bench/trainer_gpu_probe.py
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_gpu import run_config

SHAPE_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)


def ensure_model() -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = Path("/tmp/rand-1b")
    if not (path / "config.json").exists():
        cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **SHAPE_1B)
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(path)
        del m
    return path


def step(model: Any, ids: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    from trainer.cross_entropy import linear_cross_entropy_sum
    from trainer.modeling import loss_sum

    if autocast:
        loss = loss_sum(model, ids, torch.ones_like(ids), ids)
    else:
        base = model.get_base_model()
        hidden = base.get_decoder()(input_ids=ids).last_hidden_state
        loss = linear_cross_entropy_sum(hidden, base.get_output_embeddings().weight, ids)
    (loss / ids.numel()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def variant(path: Path, name: str, fused: bool, backend: str, autocast: bool) -> None:
    from trainer.modeling import load_model

    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    model = load_model(path, run_config(1, 2048, False, fused), torch.device("cuda", 0))
    model.train()
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.01)
    gen = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, SHAPE_1B["vocab_size"], (1, 2048), device="cuda", generator=gen)
    eager = step(model, ids, autocast)
    for layer in model.get_base_model().get_decoder().layers:
        layer.compile(backend=backend)
    t0 = time.time()
    compiled = step(model, ids, autocast)
    compile_s = time.time() - t0
    rel = sorted(float((compiled[k] - g).norm() / g.norm()) for k, g in eager.items())
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(5):
        step(model, ids, autocast)
    torch.cuda.synchronize()
    print(
        json.dumps(
            {
                "variant": name,
                "median_rel": round(rel[len(rel) // 2], 5),
                "max_rel": round(rel[-1], 5),
                "compile_s": round(compile_s, 1),
                "step_ms_incl_grad_copy": round((time.time() - t0) / 5 * 1e3, 1),
            }
        ),
        flush=True,
    )
    del model


def main() -> int:
    path = ensure_model()
    variants = [
        ("fused+inductor", True, "inductor", True),
        ("fused+aot_eager", True, "aot_eager", True),
        ("peft+inductor", False, "inductor", True),
        ("fused+inductor, no autocast", True, "inductor", False),
    ]
    for name, fused, backend, autocast in variants:
        try:
            variant(path, name, fused, backend, autocast)
        except Exception as e:  # a probe: report and go on
            print(json.dumps({"variant": name, "error": repr(e)[:500]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
