"""Where the gateway's workers spend their CPU, from py-spy's collapsed stacks
(`PROFILE=1 bash bench/gateway/device_workers.sh`: one `gw-wN.pyspy.txt` per worker count).

Each line is `process PID:"CMDLINE";...;frame;...;frame COUNT` (py-spy --subprocesses -f
raw: the sampled process after its parents).
The gateway's processes are its parent and its spawned workers (not the fake vLLM, not the
client); their samples are summed by the innermost frame (self) and by each module on
the stack (inclusive, once a stack), and divided by the requests the run served (its JSON)
when given, so counts of one worker and of four compare per request.

    python3 bench/gateway/profile_summary.py gw-w1.pyspy.txt [--json gw-w1.json] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

PROCESS = re.compile(r'process (\d+):"([^"]*)"')
FRAME = re.compile(r"(?P<fn>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def module_of(frame: str) -> str:
    """`fn (path/to/pkg/mod.py:12)` -> `pkg/mod.py`; frames without a file as they are."""
    m = FRAME.match(frame)
    if not m:
        return frame
    parts = Path(m["file"]).parts
    return "/".join(parts[-2:])


START_UP = ("importlib", "from_pretrained", "create_app (gateway/main.py")


def serving(frames: list[str]) -> bool:
    """A stack serving requests (the event loop, or the token-counting threads): none of a
    worker's start-up (its app's creation, its tokenizer's load, any import) is in it."""
    return not any(mark in f for f in frames for mark in START_UP)


def summarise(text: str, is_gateway: Any = None, top: int = 25) -> dict[str, Any]:
    """Samples of the gateway's processes: in all, per process, and of the stacks serving
    requests (`serving`) by innermost frame and by module (inclusive)."""
    # the gateway's parent (`lorastack.cli gateway`) and its workers (multiprocessing's
    # spawn: only the gateway spawns; the client forks and keeps gateway_latency's line)
    is_gateway = is_gateway or (lambda cmd: "cli gateway" in cmd or "spawn_main" in cmd)
    self_counts: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    other = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # a command line may hold ';' (multiprocessing's spawn: "...import spawn_main; ...")
        procs = list(PROCESS.finditer(stack))
        m = procs[-1] if procs else None  # the sampled process (its parents come first)
        cmd = m.group(2) if m else ""
        frames = [f for f in stack[m.end() if m else 0 :].split(";") if f]
        n = int(count)
        if not is_gateway(cmd):
            other += n
            continue
        processes[f"{m.group(1) if m else '?'} {cmd[:80]}"] += n
        if not serving(frames):
            continue
        if frames:
            self_counts[frames[-1]] += n
        for mod in {module_of(f) for f in frames}:
            modules[mod] += n
    total = sum(processes.values())
    return {
        "gateway_samples": total,
        "serving_samples": sum(self_counts.values()),
        "other_samples": other,
        "processes": dict(processes.most_common()),
        "self": self_counts.most_common(top),
        "modules_inclusive": modules.most_common(top),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stacks", type=Path)
    ap.add_argument(
        "--json", type=Path, help="the run's gateway_latency.py output: requests served"
    )
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    out = summarise(args.stacks.read_text(), top=args.top)
    if args.json:
        run = json.loads(args.json.read_text())
        out["run"] = run.get("summary", run)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
