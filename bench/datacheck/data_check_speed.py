"""Lines per second and peak memory of `lorastack data check` on a large chat JSONL.

Writes LINES demo conversations (written date -> ISO date, as `lorastack data make-demo`)
with 1% exact duplicates, 1% near duplicates and 0.1% broken lines, then runs the check
the CLI runs (`trainer.data.preparation.check`: every line parsed, encoded with the embedded
SmolLM2 tokenizer and its chat template, hashed) and prints one JSON object: lines/s,
wall time, peak RSS, what it found, and the command, commit and machine.

    .venv/bin/python bench/datacheck/data_check_speed.py --lines 1000000 > \
        bench/datacheck/results/$(date +%F)-$(git rev-parse --short HEAD).json

Needs the embedded base model in the store (`lorastack model import-default`) under
LORASTACK_HOME (default ~/.lorastack).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_dataset(path: Path, lines: int, seed: int) -> None:
    from trainer.data.demo_data import make_demo

    rng = random.Random(seed)
    pool = [c.model_dump() for c in make_demo(5000, seed=seed)]
    prev: dict[str, list[dict[str, str]]] | None = None
    with path.open("w", encoding="utf-8") as f:
        for i in range(lines):
            r = rng.random()
            if r < 0.001:
                f.write('{"messages": [\n')  # broken JSON
                continue
            conv = json.loads(json.dumps(pool[i % len(pool)]))
            conv["messages"][1]["content"] += f" (#{i})"  # unique unless copied below
            if prev is not None and r < 0.011:
                conv = prev  # exact duplicate of the previous conversation
            elif prev is not None and r < 0.021:  # near duplicate: differs in case only
                conv = {
                    "messages": [{**m, "content": m["content"].upper()} for m in prev["messages"]]
                }
            prev = conv
            f.write(json.dumps(conv, ensure_ascii=False) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="keep the generated file here")
    a = p.parse_args()

    from trainer.config import RunConfig
    from trainer.data.preparation import check
    from trainer.settings import TrainerSettings

    commit = subprocess.run(  # the code measured: read before it runs
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="datacheck-"))
    data = a.keep or work / "data.jsonl"
    t0 = time.monotonic()
    write_dataset(data, a.lines, a.seed)
    written_s = time.monotonic() - t0
    config = RunConfig.model_validate(
        {
            "base_model": "smollm2-135m-instruct",
            "output": "datacheck-bench",
            "dataset": {"path": str(data)},
            "max_seq_len": 256,
        }
    )
    settings = TrainerSettings(runs_dir=work / "runs")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.monotonic()
    report = check(config, settings, progress=sys.stderr.isatty())
    wall = time.monotonic() - t0
    file_bytes = data.stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "benchmark": "lorastack data check, one pass",
                "command": "python bench/datacheck/data_check_speed.py " + " ".join(sys.argv[1:]),
                "commit": commit + ("+uncommitted changes" if dirty else ""),
                "machine": {
                    "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                    "note": "2 vCPUs shared with other work while measured",
                },
                "lines": report.lines,
                "file_bytes": file_bytes,
                "wall_s": round(wall, 1),
                "lines_per_s": round(report.lines / wall),
                "peak_rss_mib": round(peak / 1024),
                "rss_before_check_mib": round(rss_before / 1024),
                "found": {
                    "line_problems": len(report.line_problems),
                    "duplicate_groups": len(report.duplicate_groups),
                    "near_duplicate_groups": len(report.near_duplicate_groups),
                    "verdict": report.verdict,
                },
                "generate_s": round(written_s, 1),
            },
            indent=1,
        )
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
