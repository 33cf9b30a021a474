"""How far 2 processes (DDP, FSDP) land from 1 process with the same global batch, on the
CPU, when only the float32 reduction order differs (thread counts, ranks): the spread
behind the tolerances of services/trainer/tests/test_trainer_ddp.py.

Each arm trains the test's run (SmolLM2-135M, 13 demo chats, r=4 on q/v, 3 steps of 4
samples) with LORASTACK_TORCH_THREADS and OMP_NUM_THREADS set to each of --threads; every
arm is compared with the first 1-process arm: the relative difference of each step's loss,
and for every adapter tensor |a-b|/|a| (Frobenius norms) and max|a-b|. Prints JSON.

    .venv/bin/python bench/trainer/ddp_spread.py --threads 1 2 --repeats 1
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

import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]

BASE = "smollm2-135m-instruct"
# the test's configuration (test_trainer_ddp.py: DDP, and conftest.SMALL beneath it)
RUN = {"base_model": BASE, "split": {"validation": 0.1, "test": 0.1, "seed": 0},
       "max_seq_len": 128, "lr": 1e-3, "schedule": "cosine", "warmup_steps": 1,
       "keep_checkpoints": 2, "seed": 0, "micro_batch": 2, "grad_accum": 2, "max_steps": 3,
       "checkpoint_every": 1, "eval_every": 100, "epochs": 1, "gradient_checkpointing": True,
       "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
ARMS = {
    "one": {"micro_batch": 4, "grad_accum": 1},
    "ddp": {},
    "fsdp": {"distributed": "fsdp"},
}


def train(home: Path, runs: Path, name: str, data: Path, arm: str, threads: int) -> float:
    cfg = runs.parent / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, **ARMS[arm], "output": name,
                                   "dataset": {"path": str(data)}}))  # fmt: skip
    env = {**os.environ, "LORASTACK_HOME": str(home), "LORASTACK_RUNS_DIR": str(runs),
           "LORASTACK_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    env.pop("LORASTACK_STORE_URL", None)
    launch = [] if arm == "one" else ["-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "2"]  # fmt: skip
    cmd = [sys.executable, *launch, "-m", "lorastack.cli", "train", str(cfg)]
    t = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return time.monotonic() - t


def compare(runs: Path, ref: str, other: str) -> dict[str, float]:
    from trainer.records import read_series

    la = read_series(runs / ref / "metrics", "metrics", "loss")
    lb = read_series(runs / other / "metrics", "metrics", "loss")
    wa = load_file(runs / ref / "adapter" / "adapter_model.safetensors")
    wb = load_file(runs / other / "adapter" / "adapter_model.safetensors")
    rel = [float((wb[k] - w).norm() / w.norm()) for k, w in wa.items()]
    return {
        "loss_rel_max": max(abs(lb[s] - la[s]) / abs(la[s]) for s in la),
        "tensor_rel_norm_max": max(rel),
        "max_abs": max(float((wb[k] - w).abs().max()) for k, w in wa.items()),
        "all_rel_norm": float(
            torch.cat([(wb[k] - w).flatten() for k, w in wa.items()]).norm()
            / torch.cat([w.flatten() for w in wa.values()]).norm()
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    args = ap.parse_args()

    from lorastack.base_model import import_folder
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo
    from trainer.settings import TrainerSettings

    tmp = Path(tempfile.mkdtemp(prefix="ddp-spread-"))
    home, runs = tmp / "home", tmp / "runs"
    # the SmolLM2 folder the tests converted (conftest.embedded_model; run a test first)
    model = next((REPO / ".cache" / "test-home" / "models").glob("smollm2-*"))
    import_folder(TrainerSettings(home=home, store_url=""), model, name=BASE)
    data = tmp / "ddp.jsonl"
    write_jsonl(data, make_demo(13, seed=3))
    names, seconds = [], {}
    for rep in range(args.repeats):
        for threads in args.threads:
            for arm in args.arms:
                name = f"{arm}-t{threads}-r{rep}"
                seconds[name] = round(train(home, runs, name, data, arm, threads), 1)
                names.append(name)
    ref = names[0]
    print(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "reference": ref, "seconds": seconds,
        "against_reference": {n: compare(runs, ref, n) for n in names[1:]},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
