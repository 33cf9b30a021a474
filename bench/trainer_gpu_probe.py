"""GPU probe: where the trainer's step time goes on the Llama-3.1-8B shape, and which
changes pay. Not a benchmark of record (bench/trainer_gpu.py is); it prints one JSON
line per variant and writes the profiler tables under $OUT.

usage (CUDA machine, repo root):
  PYTHONPATH=libs/lorastack/src:services/trainer/src:bench python3 bench/trainer_gpu_probe.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_gpu import run_config, steps

SHAPE_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
OUT = Path(os.environ.get("OUT", "/tmp/out"))


def ensure_model(shape: str = "8b") -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = Path(f"/tmp/rand-{shape}")
    if not (path / "config.json").exists():
        cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **SHAPE_8B)
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(path)
        del m
        torch.cuda.empty_cache()
    return path


def emit(name: str, r: dict[str, Any]) -> None:
    r = {k: v for k, v in r.items() if k != "losses"} | {"losses_head": r.get("losses", [])[:3]}
    print(json.dumps({"variant": name, **r}), flush=True)


def set_ckpt(model: Any, layers_checkpointed: int) -> None:
    base = model.get_base_model()
    for i, layer in enumerate(base.model.layers):
        layer.gradient_checkpointing = i < layers_checkpointed


def profile_step(model: Any, vocab: int, tag: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from trainer.modeling import loss_sum

    ids = torch.randint(0, vocab, (1, 2048), device="cuda")
    mask = torch.ones_like(ids)
    for _ in range(2):
        loss_sum(model, ids, mask, ids).backward()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss = loss_sum(model, ids, mask, ids) / 2047
        loss.backward()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    avg = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in avg)
    table = avg.table(sort_by="self_device_time_total", row_limit=40)
    (OUT / f"profile-{tag}.txt").write_text(table)
    kernels = sorted(
        ((e.key, e.self_device_time_total, e.count) for e in avg if e.self_device_time_total > 0),
        key=lambda x: -x[1],
    )[:14]
    print(
        json.dumps(
            {
                "profile": tag,
                "wall_ms_with_profiler": round(wall * 1e3, 1),
                "gpu_kernel_ms": round(gpu_us / 1e3, 1),
                "top": [(k[:70], round(us / 1e3, 1), n) for k, us, n in kernels],
            }
        ),
        flush=True,
    )


def load(path: Path, fused: bool, compiled: bool = False) -> Any:
    import gc

    from trainer.modeling import load_model

    gc.collect()
    torch.cuda.empty_cache()
    model = load_model(path, run_config(1, 2048, True, fused), torch.device("cuda", 0))
    model.train()
    if compiled:
        compile_layers(model)
    return model


def compile_layers(model: Any) -> None:
    for layer in model.get_base_model().model.layers:
        layer.compile()


def one_step_grads(model: Any, vocab: int) -> tuple[float, dict[str, torch.Tensor]]:
    from trainer.modeling import loss_sum

    gen = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, vocab, (1, 2048), device="cuda", generator=gen)
    loss = loss_sum(model, ids, torch.ones_like(ids), ids) / 2047
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def compile_check(path: Path, vocab: int) -> Any:
    """One step's LoRA gradients, eager vs compiled layers, on the same model and data."""
    model = load(path, True)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    set_ckpt(model, 0)
    loss_e, g_e = one_step_grads(model, vocab)
    compile_layers(model)
    loss_c, g_c = one_step_grads(model, vocab)
    rel = sorted(
        float((g_c[n] - g).norm() / (g.norm() + 1e-30)) if n in g_c else float("inf")
        for n, g in g_e.items()
    )
    print(
        json.dumps(
            {
                "compile_check": "one step, eager vs compiled, |g_c - g_e| / |g_e| per tensor",
                "loss_eager": loss_e,
                "loss_compiled": loss_c,
                "tensors": len(g_e),
                "median": rel[len(rel) // 2],
                "max": rel[-1],
                "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            }
        ),
        flush=True,
    )
    del model


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(sys.argv[1:])
    t0 = time.time()
    path = ensure_model()
    print(json.dumps({"model_written_s": round(time.time() - t0)}), flush=True)
    vocab = SHAPE_8B["vocab_size"]
    n = 8
    compile_check(path, vocab)
    plans = {
        "fused": (True, False, [(32, 1), (0, 1)]),
        "fused+compile": (True, True, [(32, 1), (16, 1), (8, 1), (0, 1), (0, 2), (32, 4)]),
    }
    for name, (fused, compiled, plan) in plans.items():
        if only and name not in only:
            continue
        model = None
        try:
            model = load(path, fused, compiled)
            for k, b in plan:
                set_ckpt(model, k)
                t1 = time.time()
                r = steps(model, b, 2048, vocab, n)
                emit(f"{name}-ckpt{k}-b{b}", r | {"wall_s": round(time.time() - t1, 1)})
            if compiled:
                set_ckpt(model, 0)
                profile_step(model, vocab, "compiled-ckpt0")
        except Exception as e:  # a probe: report and go on
            print(json.dumps({"variant": name, "error": repr(e)[:800]}), flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
