"""Packing on and off on the CPU: `lorastack train` (the CLI, start to published adapter)
twice on the same chats, once with `packing: true` and once with `packing: false`, with
the embedded SmolLM2-135M-Instruct.

The chats are bench/trainer/chat_mix.py's long-tailed mix shrunk to fit a CPU (lengths
30..--max-tokens). Both arms train one epoch over all of them, so they see the same chats
and the same tokens; the padded arm takes --micro-batch x --grad-accum chats a step and
the packed arm --packed-micro-batch x --grad-accum rows of --seq tokens, sized so that a
step holds about as many tokens in both (the default median makes 8 chats about 2 rows).

Prints one JSON object: per arm the wall seconds from the command's start to the adapter,
optimizer steps, non-padding and supervised tokens and their rate over that wall time,
positions computed (rows x width, summed over the micro-batches of the run's batch plan,
replayed from the trainer's own split and encoding) and the padding fraction they hold,
peak RSS, and the losses (last 10 and their mean).

usage (repo root, the project's virtualenv):
  .venv/bin/python bench/trainer/packing_cpu.py [--n 32] [--threads 2] [--home DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import chat_mix  # noqa: E402
from gpu_e2e import finished, timed  # noqa: E402


def run_config(args: argparse.Namespace, data: Path, packing: bool) -> dict[str, Any]:
    return {
        "output": f"packing-{'on' if packing else 'off'}",
        "dataset": {"path": str(data)},
        "split": {"validation": 0.0, "test": 0.0, "seed": 0},
        "quantization": "none",
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "max_seq_len": args.seq,
        "packing": packing,
        "micro_batch": args.packed_micro_batch if packing else args.micro_batch,
        "grad_accum": args.grad_accum,
        "lr": 2e-4,
        "epochs": 1,
        "gradient_checkpointing": True,
        "checkpoint_every": 10000,
        "eval_every": 10000,
        "log_every": 1,
        "device": "cpu",
        "seed": 0,
    }


def batch_plan(cfg: dict[str, Any], env: dict[str, str], staging: Path) -> dict[str, int]:
    """Positions computed and non-padding tokens over the run's micro-batches, from the
    trainer's own split, encoding and batch plan (what `lorastack train` collated)."""
    from trainer.config import RunConfig
    from trainer.data.batching import Plan
    from trainer.data.preparation import prepare
    from trainer.settings import TrainerSettings

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        config = RunConfig.model_validate(cfg)
        samples = prepare(config, TrainerSettings(), staging).encoded["train"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    lengths = [s.length for s in samples]
    pack_to = config.max_seq_len if config.packing else None
    plan = Plan(config.seed, lengths, config.micro_batch, config.grad_accum, pack_to)
    positions = tokens = rows = 0
    for step in range(plan.steps_per_epoch()):
        for micro in plan.step(step):
            widths = [sum(lengths[i] for i in row) for row in micro]
            positions += len(micro) * (pack_to or max(widths))
            tokens += sum(widths)
            rows += len(micro)
    return {
        "plan_steps": plan.steps_per_epoch(),
        "samples": len(lengths),
        "rows": rows,
        "positions": positions,
        "plan_tokens": tokens,
    }


def arm(
    args: argparse.Namespace, data: Path, packing: bool, env: dict[str, str], work: Path
) -> dict[str, Any]:
    cfg = run_config(args, data, packing)
    path = work / f"{cfg['output']}.yaml"
    path.write_text(json.dumps(cfg, indent=1))
    log = work / f"{cfg['output']}.log"
    wall, code = timed([args.lorastack, "train", str(path)], env, log, args.limit)
    row: dict[str, Any] = {
        "arm": cfg["output"],
        "micro_batch": cfg["micro_batch"],
        "grad_accum": cfg["grad_accum"],
        "wall_s": round(wall, 1),
        "rc": code,
    }
    found = finished(Path(env["LORASTACK_HOME"]) / "runs" / cfg["output"])
    if code != 0 or found is None:
        return row | {"error": log.read_text()[-3000:]}
    completion, steps = found
    plan = batch_plan(cfg, env, work / f"{cfg['output']}-plan")
    losses = [round(r["loss"], 4) for r in steps]
    return row | {
        "steps": completion["steps"],
        "tokens": completion["tokens"],
        "supervised_tokens": completion["supervised_tokens"],
        "tokens_per_s_wall": round(completion["tokens"] / wall, 1),
        "supervised_per_s_wall": round(completion["supervised_tokens"] / wall, 1),
        "train_wall_s": completion["wall_s"],
        **plan,
        "plan_matches_trainer": plan["plan_tokens"] == completion["tokens"],
        "padding_fraction": round(1 - plan["plan_tokens"] / plan["positions"], 4),
        "tokens_per_step": round(completion["tokens"] / max(1, completion["steps"]), 1),
        "peak_rss_mib": round(completion["peak_memory"] / 2**20),
        "step_s": [round(r["step_time_s"], 2) for r in steps],
        "losses": losses,
        "last10_loss_mean": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "device": completion.get("device"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32, help="chats (all trained on, one epoch)")
    ap.add_argument("--max-tokens", type=int, default=256, help="longest chat")
    ap.add_argument("--median", type=float, default=45.0, help="median chat length")
    ap.add_argument("--seq", type=int, default=256, help="max_seq_len (and a packed row)")
    ap.add_argument("--micro-batch", type=int, default=4, help="chats a micro-batch, padded")
    ap.add_argument("--packed-micro-batch", type=int, default=1, help="rows, packed")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    ap.add_argument("--arms", default="on,off", help="packing on, off, in this order")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds per arm")
    ap.add_argument("--home", type=Path, help="LORASTACK_HOME (default: a new temporary one)")
    ap.add_argument("--lorastack", default=str(Path(sys.executable).parent / "lorastack"))
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",")]
    if not arms or any(a not in ("on", "off") for a in arms):
        ap.error("--arms takes 'on', 'off' or both, comma-separated")
    if args.max_tokens > args.seq:
        ap.error(f"--max-tokens ({args.max_tokens}) must fit --seq ({args.seq})")

    home = args.home or Path(tempfile.mkdtemp(prefix="packing-cpu-"))
    work = home / "bench"
    work.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"LORASTACK_HOME": str(home), "LORASTACK_TORCH_THREADS": str(args.threads)}
    start = time.monotonic()
    code = subprocess.run(
        [args.lorastack, "model", "import-default"], env=env, capture_output=True, text=True
    )
    if code.returncode != 0:
        print(code.stdout + code.stderr, file=sys.stderr)
        return 1
    import_s = round(time.monotonic() - start, 1)
    model_dir = next((home / "models").glob("*/tokenizer.json")).parent

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = chat_mix.make(tokenizer, args.n, 0, args.max_tokens, args.median)
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = sorted(chat_mix.count(tokenizer, r["messages"]) for r in rows)
    out: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at start",
        "threads": args.threads,
        "import_s": import_s,
        "chats": {
            "n": len(sizes),
            "tokens": sum(sizes),
            "median": sizes[len(sizes) // 2],
            "p90": sizes[len(sizes) * 9 // 10],
            "max": sizes[-1],
        },
        "arms": [arm(args, data, a == "on", env, work) for a in arms],
    }
    done = {r["arm"]: r for r in out["arms"] if "steps" in r}
    if {"packing-on", "packing-off"} <= done.keys():
        on, off = done["packing-on"], done["packing-off"]
        out["ratio_on_off"] = {
            k: round(on[k] / off[k], 2)
            for k in ("tokens_per_s_wall", "supervised_per_s_wall", "positions")
        } | {"wall_s": round(on["wall_s"] / off["wall_s"], 2)}
    print(json.dumps(out, indent=1))
    return 0 if len(done) == len(arms) else 1


if __name__ == "__main__":
    raise SystemExit(main())
