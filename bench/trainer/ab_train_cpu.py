"""`lorastack train` on the demo task, two installs interleaved (A B A B ...): the wall time of
the command users run, for a refactor that must not change speed (issue 36: within 3%).

    python3 bench/trainer/ab_train_cpu.py --a .venv/bin/lorastack --b .venv/bin/lorastack \
        --b-pythonpath NEW/services/trainer/src --runs 4 --home /tmp/ab-home > result.json

One venv for both arms, the other checkout's trainer first on B's PYTHONPATH: two venvs built
apart differ by themselves (a fresh one's `import torch` held 46 MB more, its .pyc files
not yet written).

Both arms share one LORASTACK_HOME (the embedded base imported once, the demo data written
once, untimed); each run trains its own output name. Prints JSON: every run's wall seconds and
CPU seconds (user + system of the run's processes), their medians and B/A.

`--threads 1` runs every arm on one torch thread (OMP_NUM_THREADS=1): its CPU seconds are then
what the code costs, nearly independent of what else the machine runs (wall time on a shared
2-core VM varied by 25% between runs of one arm; a single thread does not spin waiting for a
sibling that the scheduler has put aside).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="the `lorastack` of install A")
    ap.add_argument("--b", required=True, help="the `lorastack` of install B")
    ap.add_argument("--b-pythonpath", help="PYTHONPATH of arm B (its trainer's src folder)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--home", type=Path, default=Path("/tmp/ab-home"))
    ap.add_argument("--threads", type=int, help="torch threads of every run (OMP_NUM_THREADS)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. max_steps=6")
    args = ap.parse_args()
    env = dict(os.environ, LORASTACK_HOME=str(args.home), HF_HUB_OFFLINE="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    data = args.home / "demo-dates.jsonl"
    subprocess.run([args.a, "model", "import-default"], env=env, check=True, capture_output=True)
    subprocess.run(
        [args.a, "data", "make-demo", str(data)], env=env, check=True, capture_output=True
    )
    config = subprocess.run(
        [str(Path(args.a).parent / "python"), "-c",
         "from importlib.resources import files; print(files('trainer') / 'configs' / 'demo.yaml')"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    seconds: dict[str, list[float]] = {"a": [], "b": []}
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(args.runs):
        for arm in ("a", "b") if i % 2 == 0 else ("b", "a"):
            cmd = [
                getattr(args, arm),
                "train",
                config,
                f"dataset.path={data}",
                f"output=ab-{arm}-{i}",
                *args.overrides,
            ]
            arm_env = dict(env)
            if arm == "b" and args.b_pythonpath:
                arm_env["PYTHONPATH"] = args.b_pythonpath
            c0 = _children_cpu()
            t0 = time.perf_counter()
            subprocess.run(cmd, env=arm_env, check=True, capture_output=True)
            seconds[arm].append(round(time.perf_counter() - t0, 2))
            cpu[arm].append(round(_children_cpu() - c0, 2))
            print(f"run {i + 1} {arm}: {seconds[arm][-1]} s, {cpu[arm][-1]} s CPU", file=sys.stderr)
    med = {arm: statistics.median(s) for arm, s in seconds.items()}
    med_cpu = {arm: statistics.median(s) for arm, s in cpu.items()}
    print(json.dumps({"a": args.a, "b": args.b, "b_pythonpath": args.b_pythonpath,
                      "threads": args.threads, "overrides": args.overrides, "seconds": seconds, "median_s": med,
                      "b_over_a": round(med["b"] / med["a"], 4), "cpu_s": cpu,
                      "median_cpu_s": med_cpu, "cpu_b_over_a": round(med_cpu["b"] / med_cpu["a"], 4),
                      "load": os.getloadavg()}, indent=1))  # fmt: skip
    return 0


def _children_cpu() -> float:
    """User + system CPU seconds of every child waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


if __name__ == "__main__":
    sys.exit(main())
