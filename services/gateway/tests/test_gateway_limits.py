"""Per-key limits in this process and in Redis: the same answers from both limiters,
atomic admission across replicas, a Redis that is down or silent, and two gateway
processes sharing one key's limit through one real `redis-server`."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from test_gateway_proxy import METRICS, METRICS_KEY

from gateway import limits, redis_limits
from gateway.auth import Authenticator, Key
from gateway.errors import BudgetExhausted, RateLimited
from gateway.keys import KeyEntry, KeysFile, hash_secret, save_keys
from gateway.limits import Budget, MemoryLimiter, Reservation, TokenBucket
from gateway.metrics import GatewayMetrics
from gateway.redis_limits import RedisLimiter
from gateway.settings import GatewaySettings
from lorastack_testing.net import free_port
from lorastack_testing.redis_server import require_redis_server, serve_redis


def admit(auth: Authenticator, key: Key, tokens: int) -> Reservation:
    """`auth.admit` from synchronous test code."""
    return asyncio.run(auth.admit(key, tokens))


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    require_redis_server()
    with serve_redis() as url:
        yield url


def utc(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()  # type: ignore[misc]


def key(name: str, rpm: int = 0, tpm: int = 0, budget: int = 0) -> Key:
    return Key(
        name,
        None,
        TokenBucket(rpm) if rpm else None,
        TokenBucket(tpm) if tpm else None,
        Budget(budget, "hour") if budget else None,
    )


Clocks = tuple[list[float], list[float]]
Make = Callable[[Clocks], Awaitable[Any]]


async def memory(clocks: Clocks) -> MemoryLimiter:
    now, wall = clocks
    return MemoryLimiter(lambda: now[0], lambda: wall[0])


def redis_limiter(url: str, prefix: str, clocks: Clocks | None = None) -> RedisLimiter:
    now, wall = clocks or ([0.0], [time.time()])
    return RedisLimiter(
        Redis.from_url(url, socket_timeout=30),  # a deadline: a slow answer is not "down"
        GatewayMetrics(),
        prefix=prefix,
        fallback=MemoryLimiter(lambda: now[0], lambda: wall[0]),
        clock=(lambda: now[0]) if clocks else None,
        wall=lambda: wall[0],
    )


async def settle(limiter: Any) -> None:
    if isinstance(limiter, RedisLimiter):
        await limiter.settle()


async def same_answers(make: Make) -> None:
    """The scenario both limiters must answer alike (a fake clock for both)."""
    clocks: Clocks = ([0.0], [utc(2036, 12, 1, 15, 30)])  # Redis expires a past period
    now, wall = clocks
    lim = await make(clocks)
    try:
        kid = key("kid", rpm=2, tpm=100)
        await lim.admit(kid, 40)
        await lim.admit(kid, 40)
        with pytest.raises(RateLimited) as e:  # the third request in the same instant
            await lim.admit(kid, 1)
        assert e.value.message == "rate limit reached: 2 requests per minute for this key"
        assert e.value.headers() == {
            "Retry-After": "30",
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "60s",
        }
        now[0] = 30.0
        await lim.admit(kid, 40)  # one request and 20 + 50 = 70 tokens refilled

        tok = key("tok", tpm=100)
        held = await lim.admit(tok, 70)
        with pytest.raises(RateLimited) as e:
            await lim.admit(tok, 31)
        assert e.value.message == "rate limit reached: 100 tokens per minute for this key"
        assert e.value.headers() == {
            "Retry-After": "1",  # 0.6 s, rounded up
            "x-ratelimit-limit-tokens": "100",
            "x-ratelimit-remaining-tokens": "30",
            "x-ratelimit-reset-tokens": "42s",
        }
        lim.refund(held, 20)  # the request used 50 of the 70 it reserved
        await settle(lim)
        await lim.admit(tok, 50)
        with pytest.raises(RateLimited, match="100 tokens per minute"):
            await lim.admit(tok, 1)

        alice = key("alice", budget=100)
        held = await lim.admit(alice, 60)
        with pytest.raises(BudgetExhausted) as b:
            await lim.admit(alice, 50)  # 60 + 50 > 100
        assert "has 40 of its 100 tokens for this hour left" in b.value.message
        assert "resets at 2036-12-01T16:00:00Z (in 1800 s)" in b.value.hint
        assert b.value.headers() == {"Retry-After": "1800"}
        lim.refund(held, 30)  # the request used 30 of the 60 it reserved
        await settle(lim)
        await lim.admit(alice, 70)
        with pytest.raises(BudgetExhausted, match="has used its 100 tokens"):
            await lim.admit(alice, 1)
        wall[0] = utc(2036, 12, 1, 16, 0, 1)  # the next hour: a fresh budget
        await lim.admit(alice, 100)
    finally:
        await lim.aclose()


def test_memory_limiter_answers() -> None:
    asyncio.run(same_answers(memory))


def test_redis_limiter_answers_as_the_memory_one(redis_url: str) -> None:
    async def make(clocks: Clocks) -> RedisLimiter:
        return redis_limiter(redis_url, "t-same:", clocks)

    asyncio.run(same_answers(make))


async def stale_refund(make: Make) -> None:
    """Budget 1,000/hour: a request reserves 900 at 10:59:59, 1,000 more are spent at
    11:00:01, then the first request's refund of 790 lands. It was charged to the 10:00
    hour: the 11:00 hour still admits no more than its 1,000 (before: 1,790)."""
    clocks: Clocks = ([0.0], [utc(2036, 12, 1, 10, 59, 59)])
    now, wall = clocks
    lim = await make(clocks)
    try:
        late = key("late", budget=1000)
        held = await lim.admit(late, 900)
        now[0], wall[0] = 2.0, utc(2036, 12, 1, 11, 0, 1)
        await lim.admit(late, 1000)
        lim.refund(held, 790)  # it used 110 of its 900
        await settle(lim)
        with pytest.raises(BudgetExhausted, match="has used its 1000 tokens for this hour"):
            await lim.admit(late, 1)
    finally:
        await lim.aclose()


def test_a_refund_after_the_period_rolled_over_credits_nothing_in_memory() -> None:
    asyncio.run(stale_refund(memory))


def test_a_refund_after_the_period_rolled_over_credits_nothing_in_redis(redis_url: str) -> None:
    async def make(clocks: Clocks) -> RedisLimiter:
        return redis_limiter(redis_url, "t-stale:", clocks)

    asyncio.run(stale_refund(make))


def test_a_request_admitted_during_an_outage_is_refunded_to_the_fallback() -> None:
    """Admitted by this replica's own limits while Redis was down, refunded once Redis is
    back: the refund goes to the limits that charged it, not to Redis (which would then
    give the key tokens it never took)."""
    require_redis_server()
    port = free_port()  # nothing listens yet: Redis is down
    now, wall = [100.0], [utc(2036, 12, 1, 15, 30)]

    async def run() -> None:
        client = Redis.from_url(
            f"redis://127.0.0.1:{port}/0", socket_timeout=30, retry=Retry(NoBackoff(), 0)
        )
        lim = RedisLimiter(
            client,
            GatewayMetrics(),
            prefix="t-outage:",
            fallback=MemoryLimiter(lambda: now[0], lambda: wall[0]),
            clock=lambda: now[0],
            wall=lambda: wall[0],
            now=lambda: now[0],
        )
        team = key("team", budget=1000)
        held = await lim.admit(team, 600)  # the fallback's: 600 of its 1,000
        with serve_redis(port):
            now[0] += redis_limits.REDIS_RETRY_S
            await lim.admit(team, 900)  # Redis's: 900 of its 1,000
            lim.refund(held, 500)  # the outage's request used 100 of its 600
            await lim.settle()
            with pytest.raises(BudgetExhausted, match="has 100 of its 1000"):
                await lim.admit(team, 101)  # Redis was given nothing back
            await lim.admit(team, 100)
            assert team.budget is not None and team.budget.used == 100  # the fallback was
            await lim.aclose()

    asyncio.run(run())


def test_two_limiters_on_one_redis_admit_the_limit_exactly(redis_url: str) -> None:
    """60 requests at once through two replicas' limiters, 10 per minute: exactly 10 pass,
    and the tokens bucket and budget count across both as well."""

    # one fake clock for both (the refill's and the budget period's): with the Redis
    # server's clock, a burst that took over 6 s on a loaded machine refilled an 11th
    # request, and an hour could turn between the burst and `ends` below
    clocks: Clocks = ([0.0], [time.time()])

    async def run() -> tuple[int, int, list[bytes]]:
        a = redis_limiter(redis_url, "t-two:", clocks)
        b = redis_limiter(redis_url, "t-two:", clocks)
        try:
            one = key("team", rpm=10)
            results = await asyncio.gather(
                *((a if i % 2 else b).admit(one, 0) for i in range(60)), return_exceptions=True
            )
            admitted = sum(isinstance(r, Reservation) for r in results)
            assert all(isinstance(r, Reservation | RateLimited) for r in results)
            spender = key("spender", tpm=1000, budget=500)
            held = await a.admit(spender, 300)
            with pytest.raises(BudgetExhausted, match="has 200 of its 500"):
                await b.admit(spender, 201)
            a.refund(held, 100)
            await a.settle()
            await b.admit(spender, 300)  # 200 + 100 given back on the other replica
            stored = await a.client.keys("t-two:*")
            return admitted, len(results), sorted(stored)
        finally:
            await a.aclose()
            await b.aclose()

    admitted, sent, stored = asyncio.run(run())
    assert (admitted, sent) == (10, 60)
    ends = int(limits.period_end(clocks[1][0], "hour"))
    assert stored == [  # one hash slot per key name (Redis Cluster), windowed budget key
        f"t-two:{{spender}}:budget:hour:{ends}".encode(),
        b"t-two:{spender}:tokens",
        b"t-two:{team}:requests",
    ]


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def test_redis_down_or_silent_falls_back_to_this_replicas_limits(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused (nothing listens) or silent (no reply within redis_timeout_s): the request
    is answered from this process's own buckets at once, one warning, a metric; once Redis
    answers again, the shared limits are back."""
    port = free_port()
    caplog.set_level(logging.WARNING, logger="gateway.redis_limits")

    now = [100.0]  # the clock of "Redis is tried again 1 s later", moved by the test only

    async def run() -> None:
        metrics = GatewayMetrics()
        url = f"redis://127.0.0.1:{port}/0"
        lim = RedisLimiter.from_url(url, 0.25, metrics, now=lambda: now[0])
        one = key("one", rpm=2)
        t0 = time.monotonic()
        await lim.admit(one, 0)
        await lim.admit(one, 0)
        with pytest.raises(RateLimited, match="2 requests per minute"):
            await lim.admit(one, 0)  # this replica's own bucket still limits
        assert time.monotonic() - t0 < 30  # no hang (a refused connection waits for nothing)
        assert metrics.redis_up.labels(f"127.0.0.1:{port}")._value.get() == 0
        assert metrics.redis_errors.labels("admit")._value.get() == 1  # then 1 s of memory
        now[0] += redis_limits.REDIS_RETRY_S - 0.25
        await lim.admit(key("one-b", rpm=2), 0)  # 0.75 s on: still this replica's own
        assert metrics.redis_errors.labels("admit")._value.get() == 1
        now[0] += 0.25
        await lim.admit(key("one-c", rpm=2), 0)  # 1 s on: Redis is tried again
        assert metrics.redis_errors.labels("admit")._value.get() == 2
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and f"redis at 127.0.0.1:{port} unreachable" in warnings[0]
        assert "ConnectionError" in warnings[0] and "this replica's own" in warnings[0]
        await lim.aclose()

        with silent_server() as silent:
            lim = RedisLimiter.from_url(f"redis://127.0.0.1:{silent}/0", 0.25, metrics)
            t0 = time.monotonic()
            await lim.admit(key("two", rpm=5), 0)
            # waited for the timeout (never less), once: one error, no retry (no upper bound
            # on the wall clock: a loaded machine decides that)
            assert 0.2 < time.monotonic() - t0 < 30
            assert metrics.redis_errors.labels("admit")._value.get() == 3
            await lim.aclose()

        monkeypatch.setattr(redis_limits, "REDIS_RETRY_S", 0.0)
        with serve_redis(port):
            lim = RedisLimiter.from_url(f"redis://127.0.0.1:{port}/0", 0.25, metrics)
            lim._down, lim._down_until = True, 0.0  # as after an outage
            metrics.redis_up.labels(f"127.0.0.1:{port}").set(0)
            await lim.admit(key("three", rpm=1), 0)
            assert metrics.redis_up.labels(f"127.0.0.1:{port}")._value.get() == 1
            assert "answers again" in caplog.records[-1].getMessage()
            await lim.aclose()

    asyncio.run(run())


def test_redis_url_setting(tmp_path: Path) -> None:
    assert GatewaySettings(home=tmp_path, redis_url="").redis_url is None  # type: ignore[arg-type]
    s = GatewaySettings(home=tmp_path, redis_url="redis://:pw@cache:6379/2")  # type: ignore[arg-type]
    assert "pw" not in repr(s)
    with pytest.raises(ValidationError, match=r"redis_url must start with redis://"):
        GatewaySettings(home=tmp_path, redis_url="http://cache:6379")  # type: ignore[arg-type]
    auth = Authenticator.from_settings(s, GatewayMetrics())
    assert isinstance(auth.limiter, RedisLimiter) and auth.limiter.fallback is auth.memory
    assert auth.limiter.where == "redis at cache:6379"  # never the password
    assert Authenticator.from_settings(GatewaySettings(home=tmp_path), GatewayMetrics()).limiter


# --- two gateway processes, one Redis, one key ----------------------------------------
LIMIT = 4  # requests per minute for the key
AUTH = {"Authorization": "Bearer sk-team"}


def _start_gateway(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorastack.cli", "gateway"],
            env={**env, "LORASTACK_PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}"


def _serving(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    """Up, and its backend's model listed (no tokenizer needed: /tokenize is passed on)."""
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        r = httpx.get(f"{url}/v1/models", headers=AUTH)
    except httpx.TransportError:
        return False
    return r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["smollm2"]


def test_two_gateway_processes_enforce_one_keys_limit(
    redis_url: str, fake: tuple[str, Any], tmp_path: Path
) -> None:
    """The issue's test. Requests go to /tokenize, which takes the same admission as chat
    (`Authenticator.admit`) without loading a tokenizer: a gateway is up in seconds."""
    keys = tmp_path / "keys.yaml"
    entry = KeyEntry(name="team", sha256=hash_secret("sk-team"), requests_per_min=LIMIT)
    save_keys(keys, KeysFile(keys=[entry]))
    env = {
        **os.environ,
        "LORASTACK_HOME": str(tmp_path / "home"),
        "LORASTACK_BACKENDS": fake[0],
        "LORASTACK_AUTH_ENABLED": "true",
        "LORASTACK_KEYS_FILE": str(keys),
        "LORASTACK_METRICS_KEY": METRICS_KEY,
        "LORASTACK_REDIS_URL": redis_url.replace("/0", "/1"),  # a db of its own
        "LORASTACK_SCRAPE_INTERVAL_S": "0.2",
        # the longest allowed: a Redis reply slower than the 0.25 s default on a loaded
        # machine made a gateway answer from its own buckets (then 6 x 200, not 4 + 2 x 429)
        "LORASTACK_REDIS_TIMEOUT_S": "10",
    }
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start_gateway(env, log) for log in logs]
    try:
        deadline = time.monotonic() + 120
        while not all(_serving(p, u, log) for (p, u), log in zip(procs, logs, strict=True)):
            assert time.monotonic() < deadline, "the gateways did not start"
            time.sleep(0.1)
        urls = [u for _, u in procs]
        body = {"model": "smollm2", "prompt": "hello there"}
        answers = [
            httpx.post(f"{urls[i % 2]}/tokenize", json=body, headers=AUTH, timeout=30)
            for i in range(LIMIT + 2)
        ]
        codes = [r.status_code for r in answers]
        assert codes == [200] * LIMIT + [429, 429], [r.text for r in answers]
        for refused in answers[LIMIT:]:  # from either gateway
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert refused.json()["error"]["message"].startswith(
                f"rate limit reached: {LIMIT} requests per minute"
            )
            assert 1 <= int(refused.headers["retry-after"]) <= 15  # 60 s / 4 per refill
            assert refused.headers["x-ratelimit-limit-requests"] == str(LIMIT)
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        admitted = []
        for url in urls:
            text = httpx.get(f"{url}/metrics", headers=METRICS).text
            redis = redis_url.removeprefix("redis://").removesuffix("/0")
            assert f'lorastack_gateway_redis_up{{redis="{redis}"}} 1.0' in text
            prefix = 'lorastack_gateway_key_requests_total{key="team"}'
            line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
            admitted.append(float(line.split()[-1]))
        assert admitted == [LIMIT / 2, LIMIT / 2]
    finally:
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait(timeout=30)


def test_a_redis_outage_with_workers_keeps_each_keys_limits_across_them() -> None:
    """Issue 58, finding 4: with `--workers 2` and Redis down, each worker fell back to the
    key's whole limits, so the replica gave it twice its limit. Each worker now counts
    half (`WorkerShare`): together they admit the limit, not more. Nothing listens on the
    port: every admission is refused by Redis at once. The clocks stand still, so no
    bucket refills during the test, however long it takes."""
    from gateway.auth import limiter_for

    url = f"redis://127.0.0.1:{free_port()}/0"

    async def one_worker() -> tuple[int, int]:
        """(requests, tokens) one worker admits of 10 requests of 100 tokens."""
        memory = MemoryLimiter(lambda: 100.0, lambda: 1e9)
        lim = limiter_for(url, 0.25, GatewayMetrics(), memory, workers=2)
        team = key("team", rpm=4, tpm=1000, budget=10_000)  # each worker's own Key
        admitted = 0
        for _ in range(10):
            with contextlib.suppress(RateLimited, BudgetExhausted):
                await lim.admit(team, 100)
                admitted += 1
        await lim.aclose()
        return admitted, admitted * 100

    (one, one_tokens), (two, two_tokens) = asyncio.run(one_worker()), asyncio.run(one_worker())
    assert one + two == 4  # requests_per_min, across both workers
    assert one_tokens + two_tokens <= 1000
