"""The command users run, on data shaped like theirs: `lorastack train` from its start to
the published adapter, against TRL's SFTTrainer on the same chats, model and tokens per
optimizer step, in one call on one GPU.

Builds a random-weight model of a real shape with the real SmolLM2 tokenizer, a chat
dataset with a long-tailed length mix (bench/trainer/chat_mix.py), imports the model
with `lorastack model import`, then runs each arm as its own process, one after the
other:
  lorastack        `lorastack train` with packing and the CUDA defaults (compile auto,
                   gradient checkpointing auto: as few layers as the GPU's memory needs)
  lorastack:X      the same with compile forced: X = layers or decoder (compile_scope),
                   or eager (compile false); or X = padded (no packing), ckpt (every
                   layer checkpointed), nogc (none, compiled); a second run of a kind finds
                   its compile cache warm
  trl-best         SFTTrainer, packing (bfd, padding-free) and Liger kernels, gradient
                   checkpointing (TRL's default; without it measured no faster)
  trl-wrapped      SFTTrainer, packing "wrapped" (no padding-free) and Liger kernels
  trl-default      SFTTrainer defaults: no packing, micro-batches padded per batch
  trl-X:nogc       that TRL arm without gradient checkpointing
  lorastack...@DIR that lorastack arm with the packages installed in DIR ahead of the rest
                   (PYTHONPATH and DIR/bin ahead on PATH): two versions of the trainer in
                   one call (with --cold each arm compiles from empty caches)
Prints one JSON object per arm (wall seconds from the command's start to the adapter on
disk or in the store, non-padding and supervised tokens per second of that wall time,
peak memory, losses) and a summary with each arm's ratio to the lorastack run.

usage (CUDA machine; lorastack installed with its entry points, trl, peft, bitsandbytes,
liger-kernel importable):
  python3 bench/trainer/gpu_e2e.py --tokenizer DIR --shape 1b [--steps 150] \
      [--micro-batch 2] [--grad-accum 2] [--seq 2048] [--arms lorastack,trl-best,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import chat_mix  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B and Llama-3.1-8B widths, the SmolLM2 vocabulary; "8b-8l" keeps 8 of the
    # 8B shape's 32 layers so that every arm fits one device call
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "8b-8l": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8,
              "num_attention_heads": 32, "num_key_value_heads": 8},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2},
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_model(shape: str, tokenizer: Path, out: Path) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.monotonic()
    config = LlamaConfig(
        **SHAPES[shape], vocab_size=49152, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)
    return time.monotonic() - start


def timed(cmd: list[str], env: dict[str, str], log: Path, limit: float) -> tuple[float, int]:
    start = time.monotonic()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
            code = rc.returncode
        except subprocess.TimeoutExpired:
            code = -9
    return time.monotonic() - start, code


def finished(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A finished run's completion record and its step records in step order (None when
    the run did not finish)."""
    done = run_dir / "training-complete.json"
    if not done.is_file():
        return None
    steps = sorted(
        (json.loads(p.read_text()) for p in (run_dir / "metrics").glob("metrics-step-*.json")),
        key=lambda r: r["step"],
    )
    return json.loads(done.read_text()), steps


VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    "layers": {"compile": True, "compile_scope": "layers"},
    "decoder": {"compile": True, "compile_scope": "decoder"},
    "eager": {"compile": False},
    # every layer checkpointed (what gradient_checkpointing auto does when memory is short)
    "ckpt": {"gradient_checkpointing": True},
    # no activation checkpointing, the layer graph compiled from the first step
    "nogc": {"gradient_checkpointing": False, "compile": True, "compile_scope": "layers"},
    # each micro-batch padded to its longest chat (width rounded up to 64), 8 chats a row
    "padded": {"packing": False, "micro_batch": 8},
}


def lorastack_arm(
    args: argparse.Namespace, name: str, env: dict[str, str], n: int
) -> dict[str, Any]:
    kind, _, site = name.partition("@")
    run = f"e2e-{n}-{kind.replace(':', '-')}"
    fields = VARIANTS[kind.partition(":")[2]] | json.loads(args.lorastack_fields)
    if site:
        env = env | {
            "PYTHONPATH": os.pathsep.join([site, env.get("PYTHONPATH", "")]),
            "PATH": os.pathsep.join([f"{site}/bin", env["PATH"]]),
        }
    if args.cold:
        # a cold compile whatever ran before: lorastack's own compile cache emptied, and
        # inductor's and Triton's folders of this arm's own
        shutil.rmtree(Path(env["LORASTACK_HOME"]) / "cache" / "torch-compile", ignore_errors=True)
        env = env | {"TORCHINDUCTOR_CACHE_DIR": f"/tmp/{run}-inductor",
                     "TRITON_CACHE_DIR": f"/tmp/{run}-triton"}  # fmt: skip
    cfg = Path(f"/tmp/{run}.yaml")
    cfg.write_text(
        json.dumps(
            {
                "base_model": "bench-base",
                "output": run,
                "dataset": {"path": str(args.data)},
                "split": {"validation": 0.0, "test": 0.01, "seed": 0},
                "quantization": "nf4",
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
                "max_seq_len": args.seq,
                "packing": True,
                "micro_batch": args.micro_batch,
                "grad_accum": args.grad_accum,
                "lr": 2e-4,
                "max_steps": args.steps,
                "epochs": 100,
                "checkpoint_every": args.steps,
                "eval_every": args.steps,
                "log_every": 1,
                "device": "cuda",
                **fields,
            }
        )
    )
    log = args.logs / f"{run}.log"
    wall, code = timed(["lorastack", "train", str(cfg)], env, log, args.limit)
    row: dict[str, Any] = {"arm": name, "wall_s": round(wall, 1), "rc": code}
    row |= {k: fields[k] for k in ("micro_batch", "packing") if k in fields}
    found = finished(Path(env["LORASTACK_HOME"]) / "runs" / run)
    if code != 0 or found is None:
        return row | {"error": log.read_text()[-3000:]}
    completion, steps = found
    lines = log.read_text().splitlines()
    return row | {
        "steps": completion["steps"],
        "tokens": completion["tokens"],
        "supervised_tokens": completion.get("supervised_tokens"),
        "tokens_per_s_wall": round(completion["tokens"] / wall, 1),
        "supervised_per_s_wall": round((completion.get("supervised_tokens") or 0) / wall, 1),
        "train_wall_s": completion["wall_s"],
        "peak_allocated_gib": round(completion["peak_memory"] / 2**30, 2),
        "peak_reserved_gib": round((completion.get("peak_reserved") or 0) / 2**30, 2),
        "compile": completion.get("compile"),
        "phases_s": completion.get("phases_s"),
        # process start to the published adapter (the wall adds the interpreter's exit)
        "to_adapter_s": round(sum((completion.get("phases_s") or {}).values()), 1),
        "memory_parts": completion.get("memory_parts"),
        "nvml": completion.get("nvml"),
        "step_s": [round(r["step_time_s"], 3) for r in steps],
        "losses": [r["loss"] for r in steps],
        "said": [ln for ln in lines if ln.startswith(("compile", "compiled", "training "))],
    }


def trl_arm(args: argparse.Namespace, name: str, env: dict[str, str]) -> dict[str, Any]:
    kind, _, variant = name.partition(":")
    packing, liger, mb, ga = {
        "trl-best": ("bfd", True, args.micro_batch, args.grad_accum),
        "trl-wrapped": ("wrapped", True, args.micro_batch, args.grad_accum),
        # the defaults a user starts from, as measured before: 4 x 2 chats a step
        "trl-default": ("none", False, 4, 2),
    }[kind]
    out = Path(f"/tmp/trl-{kind}")
    cmd = [
        sys.executable, str(HERE / "trl_sft.py"), "--model", str(args.model),
        "--data", str(args.data), "--out", str(out), "--steps", str(args.steps),
        "--micro-batch", str(mb), "--grad-accum", str(ga), "--max-length", str(args.seq),
        "--packing", packing, *(["--liger"] if liger else []),
        *(["--no-gradient-checkpointing"] if variant == "nogc" else []),
    ]  # fmt: skip
    log = args.logs / f"{name.replace(':', '-')}.log"
    wall, code = timed(cmd, env, log, args.limit)
    found = [ln for ln in log.read_text().splitlines() if ln.startswith('{"arm"')]
    if code != 0 or not found:
        return {"arm": name, "wall_s": round(wall, 1), "rc": code, "error": log.read_text()[-3000:]}
    row = json.loads(found[-1])
    row["arm"] = name
    row["process_wall_s"] = round(wall, 1)  # with interpreter start and imports
    row["to_adapter_s"] = row["wall_s"]  # start to the saved adapter, in the process
    row["tokens_per_s_wall"] = round(row["tokens"] / wall, 1)
    row["supervised_per_s_wall"] = round(row["supervised_tokens"] / wall, 1)
    return dict(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chats", type=int, default=4000)
    ap.add_argument("--arms", default="lorastack,trl-best,trl-default")
    ap.add_argument("--lorastack-fields", default="{}", help="JSON: extra run-config fields")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="each lorastack arm compiles with empty caches (lorastack's, inductor's, Triton's)",
    )
    ap.add_argument("--limit", type=float, default=400.0, help="seconds per arm")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/e2e-logs"))
    args = ap.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    args.model = Path(f"/tmp/e2e-model-{args.shape}")
    args.data = Path("/tmp/e2e-chats.jsonl")
    env = dict(os.environ, LORASTACK_HOME=f"/tmp/e2e-home-{args.shape}", PYTHONUNBUFFERED="1")

    from transformers import AutoTokenizer

    made = make_model(args.shape, args.tokenizer, args.model)
    rows = chat_mix.make(AutoTokenizer.from_pretrained(args.tokenizer), args.chats, 0)
    args.data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    imported, code = timed(
        ["lorastack", "model", "import", str(args.model), "--name", "bench-base"],
        env, args.logs / "import.log", args.limit,
    )  # fmt: skip
    print(json.dumps({"shape": args.shape, "model_s": round(made, 1),
                      "import_s": round(imported, 1), "import_rc": code}), flush=True)  # fmt: skip
    results = []
    for n, arm in enumerate(args.arms.split(",")):
        if arm.startswith("lorastack"):
            row = lorastack_arm(args, arm, env, n)
        else:
            row = trl_arm(args, arm, env)
        row = {"shape": args.shape, "micro_batch": args.micro_batch,
               "grad_accum": args.grad_accum, "seq": args.seq} | row  # fmt: skip
        print(json.dumps(row), flush=True)
        results.append(row)
    ours = next((r for r in results if r["arm"] == "lorastack" and "error" not in r), None)
    summary = {
        f"{n}:{r['arm']}": {
            "wall_s": r["wall_s"],
            "tokens_per_s_wall": r.get("tokens_per_s_wall"),
            "lorastack_speedup": round(ours["tokens_per_s_wall"] / r["tokens_per_s_wall"], 2)
            if ours and r.get("tokens_per_s_wall")
            else None,
            "to_adapter_s": r.get("to_adapter_s"),
            "lorastack_speedup_to_adapter": round(r["to_adapter_s"] / ours["to_adapter_s"], 2)
            if ours and r.get("to_adapter_s")
            else None,
            "last10_loss": round(sum(r["losses"][-10:]) / 10, 4) if r.get("losses") else None,
        }
        for n, r in enumerate(results)
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
