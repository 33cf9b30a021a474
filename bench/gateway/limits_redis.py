"""What counting per-key limits in Redis costs an admission, against this process's own.

Run from the repo root: .venv/bin/python bench/gateway/limits_redis.py
Starts Debian's redis-server on a free loopback port, then admits 5,000 requests of one
key (requests, tokens and a budget all set, so the script touches all three) through the
memory limiter and through the Redis limiter, one at a time and 64 at once, on uvloop,
and prints the wall time per admission (p50 / p99 one at a time; mean when concurrent)
and the CPU time of this process per admission.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import uvloop

from gateway.auth import Key
from gateway.limits import Budget, MemoryLimiter, TokenBucket
from gateway.metrics import GatewayMetrics
from gateway.redis_limits import RedisLimiter
from lorastack_testing.redis_server import serve_redis

N = 5000
BIG = 10**9  # limits that never refuse: the cost of counting, not of refusing


def key() -> Key:
    return Key("bench", None, TokenBucket(BIG), TokenBucket(BIG), Budget(BIG, "day"))


async def measure(limiter: MemoryLimiter | RedisLimiter) -> tuple[float, float, float, float]:
    k = key()
    lat = []
    cpu0 = time.process_time()
    for _ in range(N):
        t = time.perf_counter()
        await limiter.admit(k, 100)
        lat.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu0) / N
    q = statistics.quantiles(lat, n=100)

    async def burst(i: int) -> None:
        for _ in range(N // 64):
            await limiter.admit(k, 100)

    t = time.perf_counter()
    await asyncio.gather(*(burst(i) for i in range(64)))
    concurrent = (time.perf_counter() - t) / (64 * (N // 64))
    return q[49] * 1e6, q[98] * 1e6, concurrent * 1e6, cpu * 1e6


async def main(url: str) -> None:
    rows = [("memory", await measure(MemoryLimiter()))]
    redis = RedisLimiter.from_url(url, 0.25, GatewayMetrics())
    rows.append(("redis", await measure(redis)))
    await redis.aclose()
    print(f"{'limiter':8} {'p50 us':>8} {'p99 us':>8} {'64 at once us':>14} {'CPU us':>8}")
    for name, (p50, p99, conc, cpu) in rows:
        print(f"{name:8} {p50:8.1f} {p99:8.1f} {conc:14.1f} {cpu:8.1f}")


if __name__ == "__main__":
    with serve_redis() as url:
        uvloop.run(main(url))
