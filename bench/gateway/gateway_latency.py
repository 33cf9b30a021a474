"""Added latency of the gateway versus calling the (fake) upstream directly; and a soak.

Starts the fake vLLM of the tests (lorastack_testing.fake_vllm) and the gateway
(`lorastack gateway`, one uvicorn worker) as separate processes on 127.0.0.1, then drives
streaming chat requests from this process with a minimal raw HTTP/1.1 client (asyncio +
uvloop; no SDK overhead in the numbers). For each concurrency it measures TTFT (to the
first SSE event) and end-to-end time, direct and through the gateway, and prints JSON.
Starting and pinning the processes, reading the gateway's state and the percentiles are
harness.py's, beside this script.

    .venv/bin/python bench/gateway/gateway_latency.py --tokenizer DIR [--duration 10] \
        [--concurrency 1 16 64 256] [--soak 600] [--lockstep] [--keep-alive] \
        [--long-prompt-streams 2] [--peer-nginx] [--workers 4 --fakes 3 --client-procs 3] \
        [--pin-gateway 0 --pin-upstream 1 --pin-client 1] \
        > bench/gateway/results/$(date +%F)-$(git rev-parse --short HEAD).json

Arrivals: each point is a closed loop of N workers; by default their first requests are
staggered over one stream's length, so requests arrive steadily; `--lockstep` starts them
together, and as every stream lasts the same they stay in bursts of N. `--pin-*` put the
three processes on CPUs of their own (taskset list syntax), so that the client and the
fake do not steal the gateway's core. `cpu_ms_per_request` is the gateway's and the
fake's CPU time (user + system) per request at 16 streams.

Peer: `--peer-nginx` also measures every point through nginx (one worker process, pinned
like the gateway, `proxy_buffering off`, kept-alive upstream connections): the cost of a
reverse-proxy hop written in C, which does no parsing, counting or routing, on the same
machine in the same run. It needs `nginx` on PATH (Debian: `apt-get install nginx`).

Upstream and client past one core: `--fakes K` starts K fakes behind the gateway (its
backends; the direct arm's worker i calls fake i % K) and `--client-procs P` splits each
point's streams over P forked client processes, pooling their latencies; with `--pace`
short enough that the closed loop's ceiling (streams / (tokens x pace)) is above what the
gateway relays, throughput then measures the gateway, not the harness.

Soak: streams through the gateway for --soak seconds, a random fraction of which the
client abandons mid-stream; before and after (and after a short settle) it records the
gateway's RSS, its open TCP connections and its in-flight gauge.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from lorastack_testing.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    REPO,
    added,
    chat_bodies,
    cores_busy,
    cpu_set,
    cpu_times,
    gateway_state,
    machine,
    metrics_excerpt,
    pct,
    process_cpu,
    start_fake,
    start_gateway,
    start_nginx,
    wait_http,
)


async def stream_once(
    port: int,
    body: bytes,
    abandon_after: int | None = None,
    pool: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """One streaming POST; returns (ttft, e2e) in seconds. Reads the chunked body raw.

    With a `pool` (a worker's own dict) the connection is kept alive and reused by the
    worker's next request, as the openai SDK's connection pool does; without one, every
    request opens its own connection and closes it."""
    t0 = time.perf_counter()
    reused = pool.pop("rw", None) if pool is not None else None
    reader, writer = reused or await asyncio.open_connection("127.0.0.1", port)
    keep = pool is not None and abandon_after is None
    finished = False
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + (b"\r\n" if keep else b"Connection: close\r\n\r\n")
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n")[0].decode())
        ttft = None
        events = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip(), 16)
            if size == 0:
                await reader.readexactly(2)  # the empty trailer section's CRLF
                break
            data = await reader.readexactly(size + 2)
            if ttft is None:
                ttft = time.perf_counter() - t0
            events += data.count(b"data: ")
            if abandon_after is not None and events >= abandon_after:
                return ttft, time.perf_counter() - t0  # hang up mid-stream
        assert ttft is not None
        finished = True
        return ttft, time.perf_counter() - t0
    finally:
        if keep and finished and pool is not None:
            pool["rw"] = (reader, writer)
        else:
            writer.close()


@dataclass
class Raw:
    """What some of a point's workers measured, before pooling (`summary`)."""

    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    errors: int = 0
    long_done: int = 0
    long_streams: int = 0  # of the point's workers, how many sent the long body
    wall: float = 0.0


async def load_raw(
    port: int | list[int],
    body: bytes,
    concurrency: int,
    duration: float,
    spread: float = 0.0,
    long: tuple[int, bytes] = (0, b""),
    keep_alive: bool = False,
    workers: range | None = None,
) -> Raw:
    """Closed loop: `concurrency` workers, each streaming one request after the other
    (each on a connection of its own that it keeps alive, with `keep_alive`); worker i
    sends to port[i % len(port)] when given several; `workers`: the ones run here (all).

    `spread` > 0 staggers the workers' first requests evenly over that many seconds (one
    stream's length): arrivals are then steady. With 0 all start at once and, as every
    stream lasts the same, stay in lockstep: bursts of `concurrency` simultaneous requests.
    `long` = (n, body): the first n workers send that body instead; the latencies are
    the other workers' (what a long prompt costs everyone else).
    """
    ports = port if isinstance(port, list) else [port]
    raw = Raw(long_streams=long[0])
    stop = time.perf_counter() + duration

    async def worker(i: int) -> None:
        pool: dict[str, Any] | None = {} if keep_alive else None
        to = ports[i % len(ports)]
        await asyncio.sleep(spread * i / concurrency)
        while time.perf_counter() < stop:
            try:
                if i < long[0]:
                    await stream_once(to, long[1], pool=pool)
                    raw.long_done += 1
                    continue
                ttft, e2e = await stream_once(to, body, pool=pool)
                raw.ttfts.append(ttft)
                raw.e2es.append(e2e)
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                raw.errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in workers or range(concurrency)))
    raw.wall = time.perf_counter() - t0
    return raw


def summary(raws: list[Raw]) -> dict[str, Any]:
    """The latencies of every worker of a point pooled, and the rate over the longest wall."""
    ttfts = [t for r in raws for t in r.ttfts]
    e2es = [t for r in raws for t in r.e2es]
    wall = max(r.wall for r in raws)
    ms = 1000.0
    return {
        "requests": len(e2es),
        **(
            {"long_prompt_requests": sum(r.long_done for r in raws)} if raws[0].long_streams else {}
        ),
        "errors": sum(r.errors for r in raws),
        "requests_per_s": round(len(e2es) / wall, 1),
        "ttft_p50_ms": round(pct(ttfts, 50) * ms, 3),
        "ttft_p99_ms": round(pct(ttfts, 99) * ms, 3),
        "e2e_p50_ms": round(pct(e2es, 50) * ms, 3),
        "e2e_p99_ms": round(pct(e2es, 99) * ms, 3),
    }


async def load(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`load_raw` (the same arguments) in this process, summarised."""
    return summary([await load_raw(*args, **kwargs)])


def _client(out: Connection, point: dict[str, Any], workers: range) -> None:
    """A client process's share of a point (`load_split`): its workers on a loop of its own."""
    import uvloop

    out.send(uvloop.run(load_raw(**point, workers=workers)))
    out.close()


def load_split(
    procs: int, point: dict[str, Any], excerpt_port: int | None = None
) -> tuple[dict[str, Any], str]:
    """One arm of a point (`load_raw`'s arguments) from `procs` client processes (worker i
    in process i % procs, forked, each pinned where this one is), their latencies pooled:
    one asyncio client tops out near ~1,500 streamed requests/s, below what several gateway
    workers relay. With `excerpt_port`, that port's /metrics read half-way through."""
    ctx = multiprocessing.get_context("fork")
    concurrency = point["concurrency"]
    ends, children = [], []
    for k in range(procs):
        mine, theirs = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_client, args=(theirs, point, range(k, concurrency, procs)))
        child.start()
        ends.append(mine)
        children.append(child)
    text = ""
    if excerpt_port is not None:
        time.sleep(point["duration"] / 2)
        text = metrics_excerpt(excerpt_port)
    raws = [end.recv() for end in ends]
    for child in children:
        child.join()
    return summary(raws), text


async def load_with_excerpt(point: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`load` of a point (`load_raw`'s arguments), with its port's /metrics read half-way."""
    task = asyncio.ensure_future(load(**point))
    await asyncio.sleep(point["duration"] / 2)
    metrics = await asyncio.get_running_loop().run_in_executor(None, metrics_excerpt, point["port"])
    return await task, metrics


async def soak(
    gw_port: int, body: bytes, proc: psutil.Process, seconds: float, concurrency: int
) -> dict[str, Any]:
    # with --workers N: the parent's RSS and connections only (its workers hold the streams)
    before = gateway_state(proc, gw_port)
    done = abandoned = errors = 0
    stop = time.perf_counter() + seconds
    samples = []
    rng = random.Random(7)

    async def worker() -> None:
        nonlocal done, abandoned, errors
        while time.perf_counter() < stop:
            cut = rng.randint(1, 12) if rng.random() < 0.3 else None
            try:
                await stream_once(gw_port, body, abandon_after=cut)
                done += cut is None
                abandoned += cut is not None
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                errors += 1

    async def sampler() -> None:
        while time.perf_counter() < stop:
            await asyncio.sleep(min(30.0, seconds / 10))
            samples.append(
                {
                    "t_s": round(seconds - (stop - time.perf_counter())),
                    **gateway_state(proc, gw_port),
                }
            )

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    during = gateway_state(proc, gw_port)
    # the gateway's pool closes keep-alive connections idle for 4 s (h1client.KEEPALIVE_S;
    # aiohttp before it: 5 s): wait, send one request so the pool is used again, then read
    # the state again
    await asyncio.sleep(6)
    await stream_once(gw_port, body)
    await asyncio.sleep(1)
    after = gateway_state(proc, gw_port)
    return {
        "seconds": seconds,
        "concurrency": concurrency,
        "completed": done,
        "abandoned_mid_stream": abandoned,
        "errors": errors,
        "before": before,
        "samples": samples,
        "right_after": during,
        "after_settle": after,
    }


def cpu_per_request(
    loop: asyncio.AbstractEventLoop,
    gw_port: int,
    body: bytes,
    gw: psutil.Process,
    fake_pids: list[int],
    seconds: float,
    spread: float,
) -> dict[str, float]:
    """CPU milliseconds (user + system, and system alone) the gateway and the fakes spend
    per request at 16 streams (less sensitive to other load on the machine than latency)."""
    procs = {"gateway": [gw], "fake_upstream": [psutil.Process(pid) for pid in fake_pids]}

    def times(who: str) -> tuple[float, float]:  # the gateway's workers too
        both = [cpu_times(p) for p in procs[who]]
        return sum(t[0] for t in both), sum(t[1] for t in both)

    before = {k: times(k) for k in procs}
    r = loop.run_until_complete(load(gw_port, body, 16, seconds, spread))
    n = max(1, r["requests"])
    out: dict[str, float] = {}
    for k in procs:
        t0, t1 = before[k], times(k)
        out[k] = round((sum(t1) - sum(t0)) / n * 1000, 2)
        out[f"{k}_system"] = round((t1[1] - t0[1]) / n * 1000, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="HF folder of SmolLM2 (the gateway counts tokens with it)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--pace", type=float, default=0.01, help="seconds between tokens (fake)")
    p.add_argument(
        "--long-prompt-streams",
        type=int,
        default=0,
        help="of each point's streams, this many send a long prompt (--long-prompt-chars); "
        "the latencies reported are the other streams'",
    )
    p.add_argument("--long-prompt-chars", type=int, default=20000)
    p.add_argument(
        "--keep-alive",
        action="store_true",
        help="each client worker reuses its connection (as the openai SDK's pool does) "
        "instead of one connection per request",
    )
    p.add_argument(
        "--peer-nginx",
        action="store_true",
        help="also measure every point through nginx (a C reverse proxy, pinned like the "
        "gateway): the cost of the extra hop alone",
    )
    p.add_argument("--soak", type=float, default=0.0, help="soak seconds (0 = none)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway worker processes (lorastack gateway --workers)",
    )
    p.add_argument(
        "--fakes",
        type=int,
        default=1,
        help="fake vLLMs behind the gateway (its backends; the direct arm spreads over them)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes a point's streams are split over (pooled latencies)",
    )
    p.add_argument("--soak-concurrency", type=int, default=32)
    for who in ("gateway", "upstream", "client"):
        p.add_argument(
            f"--pin-{who}",
            metavar="CPUS",
            help=f"run the {who} on these CPUs only (taskset list syntax: 2, 4-5, 0,6)",
        )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="start every stream of a point at once (bursts) instead of staggered",
    )
    a = p.parse_args()
    if a.peer_nginx and a.fakes > 1:
        p.error("--peer-nginx relays to one fake: leave --fakes at 1")
    spread = 0.0 if a.lockstep else a.tokens * a.pace
    if a.pin_client is not None:
        os.sched_setaffinity(0, cpu_set(a.pin_client))

    import uvloop

    fake_ports, gw_port = [free_port() for _ in range(a.fakes)], free_port()
    fake_port = fake_ports[0]
    env = dict(os.environ, HF_HUB_OFFLINE="1", LORASTACK_HOME=str(REPO / ".cache" / "bench-home"))
    fakes = [start_fake(port, a.tokens, a.pace, env, a.pin_upstream) for port in fake_ports]
    gw_env = dict(env, LORASTACK_WORKERS=str(a.workers))
    gw = start_gateway(
        gw_port, fake_port, a.tokenizer, gw_env, a.pin_gateway, upstreams=fake_ports[1:]
    )
    peers: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    if a.peer_nginx:
        nginx_port = free_port()
        peers["nginx"] = (nginx_port, start_nginx(fake_port, nginx_port, a.pin_gateway))
    try:
        for port in fake_ports:
            wait_http(port, "/v1/models")
        wait_http(gw_port, "/ready")
        for port, _ in peers.values():
            wait_http(port, "/v1/models")
        gw_proc = psutil.Process(gw.pid)
        body, long_body = chat_bodies(a.long_prompt_chars)
        long = (a.long_prompt_streams, long_body)
        results: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(a.pin_gateway, a.pin_upstream, a.pin_client),
            "workload": {
                "tokens_per_answer": a.tokens,
                "pace_s": a.pace,
                "duration_s_per_point": a.duration,
                "arrivals": "lockstep bursts" if a.lockstep else f"staggered over {spread:g} s",
                "stream": True,
                "client_connections": "kept alive per worker"
                if a.keep_alive
                else "one per request",
                "long_prompt_streams": a.long_prompt_streams,
                "long_prompt_chars": a.long_prompt_chars if a.long_prompt_streams else 0,
                "fakes": a.fakes,
                "client_processes": a.client_procs,
            },
            "points": [],
        }
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(load(gw_port, body, 4, 2.0))  # warm-up both paths
        loop.run_until_complete(load(fake_port, body, 4, 2.0))
        for port, _ in peers.values():
            loop.run_until_complete(load(port, body, 4, 2.0))
        for c in a.concurrency:
            point = {"body": body, "concurrency": c, "duration": a.duration, "spread": spread,
                     "long": long, "keep_alive": a.keep_alive}  # fmt: skip
            if a.client_procs > 1:
                direct, _ = load_split(a.client_procs, {"port": fake_ports, **point})
            else:
                direct = loop.run_until_complete(load(fake_ports, **point))
            cpu0, t0 = process_cpu(gw_proc), time.monotonic()
            if a.client_procs > 1:
                via, text = load_split(a.client_procs, {"port": gw_port, **point}, gw_port)
                results["metrics_excerpt_during_64_streams"] = text
            elif c == 64:
                via, text = loop.run_until_complete(load_with_excerpt({"port": gw_port, **point}))
                results["metrics_excerpt_during_64_streams"] = text
            else:
                via = loop.run_until_complete(load(gw_port, **point))
            busy = cores_busy(cpu0, process_cpu(gw_proc), time.monotonic() - t0)
            row: dict[str, Any] = {"concurrency": c, "direct": direct, "gateway": via}
            # the parent's share, then each worker's: a worker near 1.0 is saturated
            row["gateway_cores_busy"] = busy
            row.update(added(via, direct))
            for name, (port, _) in peers.items():
                row[name] = loop.run_until_complete(load(port, **point))
                row.update(added(row[name], direct, f"{name}_"))
            results["points"].append(row)
            print(json.dumps(results["points"][-1]), file=sys.stderr)
        results["cpu_ms_per_request"] = cpu_per_request(
            loop, gw_port, body, gw_proc, [f.pid for f in fakes], a.duration, spread
        )
        if a.soak > 0:
            results["soak"] = loop.run_until_complete(
                soak(gw_port, body, gw_proc, a.soak, a.soak_concurrency)
            )
        results["machine"]["load_avg_at_end"] = os.getloadavg()
        print(json.dumps(results, indent=2))
    finally:
        for proc in (gw, *fakes, *(proc for _, proc in peers.values())):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
