"""The model paths the GPU benches of this folder share (trainer_gpu.py,
trainer_gpu_saved.py, trainer_cpu_curve.py): the trainer's run config for a shape, the
plain transformers+peft baseline run as its own process (it writes the random-weight model
both sides load), the plain path's full-logits loss, the trainer's model loaded as
`lorastack train` loads it, and timed optimizer steps on random tokens.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEVICE = torch.device("cuda", 0)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_config(batch: int, seq: int, checkpointing: bool, **fields: Any) -> Any:
    from trainer.config import RunConfig

    return RunConfig.model_validate(
        {
            "dataset": {"path": "unused.jsonl"},
            "quantization": "nf4",
            "max_seq_len": seq,
            "micro_batch": batch,
            "gradient_checkpointing": checkpointing,
            "device": DEVICE.type,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ALL_LINEAR},
            **fields,
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
    from trainer.model.modeling import loss_sum

    loss_fn = loss_fn or loss_sum
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), device=DEVICE, generator=gen)
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
        losses.append(round(float(loss.detach()), 5))
    steady = sorted(times[3:])[len(times[3:]) // 2]
    return {
        "batch": batch,
        "seq": seq,
        "first_step_s": round(times[0], 2),
        "step_s_median": round(steady, 4),
        "tokens_per_s": round(batch * seq / steady),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "losses": losses,
    }


def set_checkpointing(model: Any, on: bool) -> None:
    """Per-layer switch of the (non-reentrant) checkpointing that load_model enabled."""
    for layer in model.get_base_model().get_decoder().layers:
        layer.gradient_checkpointing = on


def load(shape: str, seq: int, **fields: Any) -> Any:
    from trainer.model.compiling import compile_decoder, use_compile
    from trainer.model.modeling import load_model

    gc.collect()
    torch.cuda.empty_cache()
    config = run_config(1, seq, True, **fields)
    model = load_model(Path(f"/tmp/rand-{shape}"), config, DEVICE)
    if use_compile(config, DEVICE):  # as `lorastack train` does once compiling pays
        compile_decoder(model, config.compile_scope)
    model.train()
    return model
