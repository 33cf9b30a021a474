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

`--pairs N` (a machine with 2 x N x threads cores): each round runs N runs of A and N of B at
once, every run pinned to `--threads` cores of its own (A and B swap cores from round to
round), so both arms share whatever the machine does meanwhile. `--base DIR` imports that
model folder under the demo's base name instead of `model import-default` (a machine without
the embedded model: random weights of SmolLM2-135M's shape with its tokenizer, for example):

    python3 bench/trainer/ab_train_cpu.py --a /tmp/site/bin/lorastack \
        --b /tmp/site-old/bin/lorastack --b-pythonpath /tmp/site-old:/tmp/site \
        --base /tmp/smol-random --threads 2 --pairs 4 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--pairs", type=int, default=0, help="N runs of each arm at once, pinned")
    ap.add_argument("--base", type=Path, help="model folder to import as the demo's base")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. max_steps=6")
    args = ap.parse_args()
    env = dict(os.environ, LORASTACK_HOME=str(args.home), HF_HUB_OFFLINE="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    data = args.home / "demo-dates.jsonl"
    if args.base:
        imp = [args.a, "model", "import", str(args.base), "--name", "smollm2-135m-instruct"]
    else:
        imp = [args.a, "model", "import-default"]
    subprocess.run(imp, env=env, check=True, capture_output=True)
    subprocess.run(
        [args.a, "data", "make-demo", str(data)], env=env, check=True, capture_output=True
    )
    python = Path(args.a).parent / "python"
    config = subprocess.run(
        [str(python) if python.exists() else sys.executable, "-c",
         "from importlib.resources import files; print(files('trainer') / 'configs' / 'demo.yaml')"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip

    def start(arm: str, name: str, cores: str | None) -> subprocess.Popen[bytes]:
        cmd = [getattr(args, arm), "train", config, f"dataset.path={data}", f"output={name}"]
        arm_env = dict(env)
        if arm == "b" and args.b_pythonpath:
            arm_env["PYTHONPATH"] = args.b_pythonpath
        pin = ["taskset", "-c", cores] if cores else []
        with (args.home / f"{name}.log").open("wb") as log:
            return subprocess.Popen(
                [*pin, *cmd, *args.overrides], env=arm_env, stdout=log, stderr=log
            )

    seconds: dict[str, list[float]] = {"a": [], "b": []}
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(args.runs):
        if args.pairs:
            # A on the even slots in even rounds, on the odd ones in odd rounds
            t = args.threads or 1
            slots = [f"{k * t}-{k * t + t - 1}" for k in range(2 * args.pairs)]
            wave = [("a" if (k + i) % 2 == 0 else "b", slot) for k, slot in enumerate(slots)]
        else:
            wave = [(arm, None) for arm in (("a", "b") if i % 2 == 0 else ("b", "a"))]
        # without --pairs one run at a time; with it the whole wave at once
        groups = [wave] if args.pairs else [[w] for w in wave]
        for group in groups:
            t0 = time.perf_counter()
            running = {}
            for k, (arm, cores) in enumerate(group):
                proc = start(arm, name := f"ab-{arm}-{i}-{k}", cores)
                running[proc.pid] = (arm, name, proc)
            while running:
                # reaped here rather than by Popen.wait: os.wait4 gives each run its own rusage
                pid, status, ru = os.wait4(-1, 0)
                arm, name, proc = running.pop(pid)
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode:
                    log = (args.home / f"{name}.log").read_text()[-2000:]
                    raise SystemExit(f"run {name} failed: {log}")
                seconds[arm].append(round(time.perf_counter() - t0, 2))
                cpu[arm].append(round(ru.ru_utime + ru.ru_stime, 2))
                print(f"{name}: {seconds[arm][-1]} s, {cpu[arm][-1]} s CPU", file=sys.stderr)
    med = {arm: statistics.median(s) for arm, s in seconds.items()}
    med_cpu = {arm: statistics.median(s) for arm, s in cpu.items()}
    print(json.dumps({"a": args.a, "b": args.b, "b_pythonpath": args.b_pythonpath,
                      "threads": args.threads, "pairs": args.pairs, "overrides": args.overrides,
                      "seconds": seconds, "median_s": med,
                      "b_over_a": round(med["b"] / med["a"], 4), "cpu_s": cpu,
                      "median_cpu_s": med_cpu, "cpu_b_over_a": round(med_cpu["b"] / med_cpu["a"], 4),
                      "cpus": os.cpu_count(), "load": os.getloadavg()}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
