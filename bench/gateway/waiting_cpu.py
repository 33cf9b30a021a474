"""What requests waiting for KV-cache room cost the gateway's CPU (issue 58, finding 6).

One stream holds all of a fake vLLM's KV cache (its `vllm:cache_config_info` says 20
blocks of 16 tokens: one claim of 9 + 200 tokens at a time), then `--waiters` more
requests arrive and wait in the gateway's line (`kv_admit_wait_s` 300). Once every one of
them is counted waiting, the gateway's processes (the parent and its workers) are read for
CPU over `--seconds`: the cost of waiting alone, since nothing is admitted meanwhile.

    .venv/bin/python bench/gateway/waiting_cpu.py --tokenizer DIR --workers 2 --waiters 1000
    # another commit's gateway (`git archive 5815ed9 services/gateway/src | tar -x -C /tmp/old`):
    .venv/bin/python bench/gateway/waiting_cpu.py --tokenizer DIR \
        --gateway-src /tmp/old/services/gateway/src

The fake and the clients run in this process (their CPU is not counted); one JSON line
goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from harness import REPO, process_cpu, wait_http

from lorastack_testing.fake_vllm import FakeState, serve_fake
from lorastack_testing.net import free_port

BODY = {"model": "smollm2", "prompt": list(range(100, 109)), "max_tokens": 200}


async def post(port: int, body: dict[str, object]) -> asyncio.StreamWriter:
    """Send one request and keep its connection open, unread (the request stays in line)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return writer


def gauge(port: int, name: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def measure(port: int, waiters: int, seconds: float, gw: psutil.Process) -> dict[str, float]:
    holder = await post(port, BODY | {"stream": True})
    deadline = time.monotonic() + 60
    while gauge(port, "lorastack_gateway_backend_kv_claimed_tokens") <= 0:
        assert time.monotonic() < deadline, "the holder was never admitted"
        await asyncio.sleep(0.2)
    conns = [await post(port, BODY) for _ in range(waiters)]
    deadline = time.monotonic() + 120
    while gauge(port, "lorastack_gateway_kv_admission_waiting") < waiters:
        assert time.monotonic() < deadline, "not every request waits"
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # their arrival's work done
    before, t0 = process_cpu(gw), time.monotonic()
    await asyncio.sleep(seconds)
    after, wall = process_cpu(gw), time.monotonic() - t0
    busy = [
        (sum(after[pid]) - sum(before.get(pid, (0.0, 0.0)))) / wall for pid in after
    ]  # cores: 1.0 is one core all the time
    still = gauge(port, "lorastack_gateway_kv_admission_waiting")
    for w in (*conns, holder):
        w.close()
    return {"cores": round(sum(busy), 4), "per_process": [round(b, 4) for b in busy],
            "waiting_at_end": still}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokenizer", required=True, help="HF folder of SmolLM2 (the gateway counts with it)"
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--waiters", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--gateway-src", type=Path, help="import the gateway from here instead")
    a = p.parse_args()
    state = FakeState(num_gpu_blocks=20, block_size=16, pace_s=60.0)
    state.tokens = [f" t{i}" for i in range(200)]
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"waiting-cpu-{os.getpid()}"
    with serve_fake(state) as fake:
        port = free_port()
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            LORASTACK_HOME=str(home),
            LORASTACK_WORKERS=str(a.workers),
            LORASTACK_KV_ADMIT_WAIT_S="300",
            LORASTACK_TOKENIZERS=json.dumps({"smollm2": a.tokenizer}),
        )
        if a.gateway_src is not None:
            env["PYTHONPATH"] = f"{a.gateway_src}:{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, "-m", "lorastack.cli", "gateway", "--port", str(port)]
        proc = subprocess.Popen([*cmd, "--backend", fake], env=env)
        try:
            wait_http(port, "/ready")
            result = asyncio.run(measure(port, a.waiters, a.seconds, psutil.Process(proc.pid)))
        finally:
            proc.terminate()
            proc.wait(60)
    out = {"workers": a.workers, "waiters": a.waiters, "seconds": a.seconds, **result}
    out["gateway_src"] = str(a.gateway_src or REPO / "services/gateway/src")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
