"""A/B of the two HTTP clients for the gateway's upstream calls: CPU per streamed request.

Run from the repo root: .venv/bin/python bench/gateway/gateway_client_ab.py
Streams 640 chat completions (16 chunks each, no pacing) from the fake upstream with
httpx and with aiohttp, at 1 and 64 concurrent streams, and prints the client's CPU
time per request (process_time: other processes' load inflates it less than latency).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import uvloop

from lorastack_testing.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import FAKE, wait_http


async def with_httpx(url: str, body: bytes, n: int, c: int) -> None:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as cl:

        async def one() -> None:
            req = cl.build_request(
                "POST", url, content=body, headers={"content-type": "application/json"}
            )
            r = await cl.send(req, stream=True)
            async for _ in r.aiter_raw():
                pass
            await r.aclose()

        for _ in range(n // c):
            await asyncio.gather(*(one() for _ in range(c)))


async def with_aiohttp(url: str, body: bytes, n: int, c: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one() -> None:
            async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                async for _ in r.content.iter_any():
                    pass

        for _ in range(n // c):
            await asyncio.gather(*(one() for _ in range(c)))


def main() -> None:
    port = free_port()
    fake = subprocess.Popen([*FAKE, "--port", str(port), "--tokens", "16"])
    body = json.dumps(
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        wait_http(port, "/v1/models")
        for name, fn in (("httpx", with_httpx), ("aiohttp", with_aiohttp)) * 2:
            for c in (1, 64):
                loop = uvloop.new_event_loop()
                t = time.process_time()
                loop.run_until_complete(fn(url, body, 640, c))
                cpu = time.process_time() - t
                loop.close()
                print(
                    f"{name:8} {c:3} streams: client CPU {cpu / 640 * 1000:.3f} ms per request",
                    flush=True,
                )
    finally:
        fake.terminate()


if __name__ == "__main__":
    main()
