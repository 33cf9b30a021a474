"""The gateway's CPU per streamed request, two versions side by side in one run.

Starts the fake vLLM of the tests and two gateways in front of it, both pinned to the same
CPU: `old` imports its code from `--old-pythonpath` (a `git archive` of every package's
src folder of the commit to compare against), `new` from this checkout. Then, for
`--rounds` rounds, it drives one gateway, then the other (the order alternates each round:
old new, new old, ...) with the streaming client of gateway_latency.py for `--seconds`
each, and reads the CPU time (user + system) each gateway spent per request in its
phase. The idle one only scrapes its backend.

Why: on a VM whose cores other work shares, the CPU per request of one version moves by
10-30% between runs a minute apart (bench/gateway/history.md); phases of a few seconds,
interleaved, see the same machine, so the per-round ratio new / old is the number to
read, and its median over the rounds.

    .venv/bin/python bench/gateway/gateway_cpu_ab.py --old-pythonpath OLD_SRC_DIRS \
        --tokenizer DIR [--rounds 12] [--seconds 4] [--concurrency 16] [--keep-alive] \
        [--pin-gateway 0 --pin-upstream 1 --pin-client 1] > result.json

`OLD_SRC_DIRS` is a PYTHONPATH (folders joined with ':').
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil

from lorastack_testing.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_latency import load
from harness import (
    REPO,
    chat_bodies,
    cpu_set,
    cpu_times,
    machine,
    start_fake,
    start_gateway,
    wait_http,
)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--old-pythonpath", required=True, help="PYTHONPATH of the old version")
    p.add_argument("--tokenizer", required=True, help="HF folder of SmolLM2")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per arm and round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--keep-alive", action="store_true", help="clients keep connections")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--pace", type=float, default=0.01, help="seconds between tokens (fake)")
    p.add_argument(
        "--workers", type=int, default=1, help="gateway worker processes, both arms (new: N)"
    )
    for who in ("gateway", "upstream", "client"):
        p.add_argument(f"--pin-{who}", metavar="CPUS", help=f"run the {who} on these CPUs")
    a = p.parse_args()
    if a.pin_client is not None:
        os.sched_setaffinity(0, cpu_set(a.pin_client))

    import uvloop

    env = dict(os.environ, HF_HUB_OFFLINE="1", LORASTACK_HOME=str(REPO / ".cache" / "bench-home"))
    env.pop("PYTHONPATH", None)
    env["LORASTACK_WORKERS"] = str(a.workers)
    fake_port = free_port()
    fake = start_fake(fake_port, a.tokens, a.pace, env, a.pin_upstream)
    ports = {"old": free_port(), "new": free_port()}
    envs = {"old": dict(env, PYTHONPATH=a.old_pythonpath), "new": env}
    gws = {
        arm: start_gateway(ports[arm], fake_port, a.tokenizer, envs[arm], a.pin_gateway)
        for arm in ports
    }
    try:
        wait_http(fake_port, "/v1/models")
        for port in ports.values():
            wait_http(port, "/ready")
        procs = {arm: psutil.Process(gw.pid) for arm, gw in gws.items()}
        body, _ = chat_bodies(0)
        spread = a.tokens * a.pace
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        for port in ports.values():  # warm-up
            loop.run_until_complete(load(port, body, 4, 2.0, keep_alive=a.keep_alive))
        rounds: list[dict[str, Any]] = []
        for i in range(a.rounds):
            row: dict[str, Any] = {"round": i + 1, "order": []}
            for arm in ("old", "new") if i % 2 == 0 else ("new", "old"):
                t0 = cpu_times(procs[arm])  # the workers' too
                r = loop.run_until_complete(
                    load(
                        ports[arm], body, a.concurrency, a.seconds, spread, keep_alive=a.keep_alive
                    )
                )
                t1 = cpu_times(procs[arm])
                n = max(1, r["requests"])
                row["order"].append(arm)
                row[arm] = {
                    "cpu_ms_per_request": round((sum(t1) - sum(t0)) / n * 1000, 3),
                    "requests": r["requests"],
                    "errors": r["errors"],
                    "ttft_p50_ms": r["ttft_p50_ms"],
                }
            row["new_over_old"] = round(
                row["new"]["cpu_ms_per_request"] / row["old"]["cpu_ms_per_request"], 3
            )
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr)

        def med(arm: str) -> float:
            return round(statistics.median(r[arm]["cpu_ms_per_request"] for r in rounds), 3)

        ratios = [r["new_over_old"] for r in rounds]
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(a.pin_gateway, a.pin_upstream, a.pin_client),
            "workload": {
                "concurrency": a.concurrency,
                "seconds_per_arm_and_round": a.seconds,
                "client_connections": "kept alive per worker"
                if a.keep_alive
                else "one per request",
                "tokens_per_answer": a.tokens,
                "pace_s": a.pace,
                "gateway_workers": a.workers,
            },
            "cpu_ms_per_request_median": {"old": med("old"), "new": med("new")},
            "new_over_old_median": round(statistics.median(ratios), 3),
            "rounds_new_lower": sum(x < 1 for x in ratios),
            "rounds": rounds,
        }
        result["machine"]["load_avg_at_end"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        for proc in (*gws.values(), fake):
            proc.terminate()
            try:
                proc.wait(15)
            except Exception:
                proc.kill()


if __name__ == "__main__":
    main()
