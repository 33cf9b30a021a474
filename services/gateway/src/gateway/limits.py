"""Per-key limit accounting: requests and tokens per minute, and token budgets.

    Limiter                 admit(key, tokens) / refund(key, tokens) / aclose()
    ├── MemoryLimiter       this process's own buckets (the state lives in each `Key`)
    └── RedisLimiter        one Lua script per admission in Redis, shared by every
                            gateway replica that names the same `redis_url`

Both keep the same semantics: token buckets that refill continuously (capacity = the
limit per minute, starting full), a budget of tokens per calendar period (UTC), checked
budget first, then both buckets; nothing is taken when anything refuses; the refusal
names the limit that blocks longest and when to retry. `gateway.errors` turns them into
the same 429 body and headers.

Redis unreachable (refused, timed out, any Redis error): the request is checked against
this process's own buckets instead (fail open to per-replica limits, as LiteLLM's proxy
does when its Redis cache fails), logged once per outage with the reason, counted in
`lorastack_gateway_redis_errors_total`, and `lorastack_gateway_redis_up{redis}` reads 0; Redis
is tried again `REDIS_RETRY_S` later. A request is never refused, nor failed with a 500,
because Redis is down.

Owns: the arithmetic and where it runs. Does not own: which key a request is, and its
limits (`auth.py`, `keys.py`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import BudgetExhausted, RateLimited
from gateway.keys import Period, period_end
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

REDIS_RETRY_S = 1.0  # after a Redis failure, this process's own limits for this long
BUCKET_TTL_MS = 120_000  # a bucket untouched this long is full again: Redis may drop it


@dataclass
class TokenBucket:
    capacity: float  # units per minute; the bucket starts full
    level: float = -1.0
    stamp: float = 0.0  # monotonic seconds of the last refill

    def _refill(self, now: float) -> None:
        if self.level < 0:
            self.level, self.stamp = self.capacity, now
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 when `amount` is available now, else seconds until it will be."""
        self._refill(now)
        deficit = amount - self.level
        return 0.0 if deficit <= 0 else deficit * 60.0 / self.capacity

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Budget:
    tokens: int  # per period
    period: Period
    used: float = 0.0
    resets_at: float = 0.0  # epoch seconds; 0: not started

    def roll(self, now: float) -> None:
        if now >= self.resets_at:
            self.used, self.resets_at = 0.0, period_end(now, self.period)


class Limited(Protocol):
    """What a limiter needs of a key (`auth.Key`): its name and limits."""

    name: str
    requests: TokenBucket | None
    tokens: TokenBucket | None
    budget: Budget | None


class Limiter(Protocol):
    async def admit(self, key: Limited, tokens: int) -> None:
        """Take one request and `tokens` from the key's limits, or raise RateLimited /
        BudgetExhausted (nothing taken then)."""

    def refund(self, key: Limited, tokens: int) -> None:
        """Give back reserved tokens a request did not use (never raises, never waits)."""

    async def aclose(self) -> None: ...


def rate_limited(what: str, limit: float, wait: float, level: float) -> RateLimited:
    """The refusal of a bucket of `limit` per minute holding `level` that needs `wait` s."""
    return RateLimited(
        f"rate limit reached: {int(limit)} {what} per minute for this key",
        f"retry in {wait:.1f} s",
        retry_after_s=wait,
        limit=(what, int(limit), max(0, int(level)), (limit - max(0.0, level)) * 60.0 / limit),
    )


def budget_exhausted(
    name: str, budget: int, period: Period, used: float, resets_at: float, tokens: int, wall: float
) -> BudgetExhausted:
    left = max(0, int(budget - used))
    at = dt.datetime.fromtimestamp(resets_at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    wait = resets_at - wall
    what = (
        f"token budget exhausted: the key {name!r} has used its {budget} tokens for this {period}"
        if left == 0
        else f"token budget exhausted: this request needs up to {tokens} tokens (prompt +"
        f" max_tokens) but the key {name!r} has {left} of its {budget} tokens"
        f" for this {period} left"
    )
    return BudgetExhausted(
        what + ".",
        f"the budget resets at {at} (in {int(wait)} s); lower max_tokens, or ask for a"
        " larger budget",
        retry_after_s=wait,
    )


class MemoryLimiter:
    """Limits held in this process (each `Key`'s buckets and budget): one replica only."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.clock = clock
        self.wall = wall

    def check(self, key: Limited, tokens: int) -> None:
        now = self.clock()
        budget = key.budget
        if budget is not None:
            wall = self.wall()
            budget.roll(wall)
            if budget.used + tokens > budget.tokens:
                raise budget_exhausted(
                    key.name,
                    budget.tokens,
                    budget.period,
                    budget.used,
                    budget.resets_at,
                    tokens,
                    wall,
                )
        blocked = []
        for what, bucket, amount in (("requests", key.requests, 1), ("tokens", key.tokens, tokens)):
            if bucket is not None:
                wait = bucket.wait_s(amount, now)
                if wait > 0:
                    blocked.append((wait, what, bucket))
        if blocked:
            wait, what, bucket = max(blocked, key=lambda b: b[0])
            raise rate_limited(what, bucket.capacity, wait, bucket.level)
        if key.requests is not None:
            key.requests.take(1, now)
        if key.tokens is not None:
            key.tokens.take(tokens, now)
        if budget is not None:
            budget.used += tokens

    async def admit(self, key: Limited, tokens: int) -> None:
        self.check(key, tokens)

    def refund(self, key: Limited, tokens: int) -> None:
        if tokens <= 0:
            return
        if key.tokens is not None:
            key.tokens.give_back(tokens)
        if key.budget is not None:
            key.budget.used = max(0.0, key.budget.used - tokens)

    async def aclose(self) -> None:
        pass


# KEYS: requests bucket, tokens bucket, budget counter (each may be unused).
# ARGV: requests/min, tokens/min, tokens, budget tokens (0 = none for each), the budget
# counter's expiry (epoch ms), now (seconds; "" = the Redis server's clock).
# Returns {0} admitted; {1, what, limit, wait_s, level} rate limited; {2, used} over budget.
# Numbers go back as strings: Redis would cut Lua numbers to integers.
_ADMIT = """
local now = tonumber(ARGV[6])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local rpm, tpm, n, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if budget > 0 then
  local used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if used + n > budget then return {2, tostring(used)} end
end
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local l, s = tonumber(v[1]), tonumber(v[2])
  if not l then return cap end
  return math.min(cap, l + math.max(0, now - s) * cap / 60)
end
local rl, tl, worst = 0, 0, nil
if rpm > 0 then
  rl = level(KEYS[1], rpm)
  if rl < 1 then worst = {1, 'requests', tostring(rpm), tostring((1 - rl) * 60 / rpm), tostring(rl)} end
end
if tpm > 0 then
  tl = level(KEYS[2], tpm)
  if tl < n then
    local wait = (n - tl) * 60 / tpm
    if not worst or wait > tonumber(worst[4]) then
      worst = {1, 'tokens', tostring(tpm), tostring(wait), tostring(tl)}
    end
  end
end
if worst then return worst end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'level', tostring(rl - 1), 'stamp', tostring(now))
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(tl - n), 'stamp', tostring(now))
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
if budget > 0 then
  redis.call('INCRBY', KEYS[3], n)
  redis.call('PEXPIREAT', KEYS[3], ARGV[5])
end
return {0}
"""

# KEYS: tokens bucket, budget counter. ARGV: tokens/min (0 = none), tokens.
_REFUND = """
local tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 then
  local l = tonumber(redis.call('HGET', KEYS[1], 'level'))
  if l then redis.call('HSET', KEYS[1], 'level', tostring(math.min(tpm, l + n))) end
end
local used = tonumber(redis.call('GET', KEYS[2]))
if used then redis.call('SET', KEYS[2], math.max(0, used - n), 'KEEPTTL') end
return 0
"""


class RedisLimiter:
    """Limits held in Redis, one atomic script per admission: every replica that shares
    the Redis shares each key's buckets and budget (by key name)."""

    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        metrics: GatewayMetrics,
        *,
        prefix: str = "lorastack:limits:",
        fallback: MemoryLimiter | None = None,
        clock: Callable[[], float] | None = None,  # None: the Redis server's clock
        wall: Callable[[], float] = time.time,
        where: str = "redis",
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.prefix = prefix
        self.fallback = fallback or MemoryLimiter(wall=wall)
        self.clock = clock
        self.wall = wall
        self.where = where  # for log lines; never holds a password
        self._admit = client.register_script(_ADMIT)
        self._refund = client.register_script(_REFUND)
        self._down_until = 0.0
        self._down = False
        self._pending: set[asyncio.Task[None]] = set()
        self._up = metrics.redis_up.labels(where.removeprefix("redis at "))
        self._up.set(1)
        for op in ("admit", "refund"):
            metrics.redis_errors.labels(op)

    @classmethod
    def from_url(cls, url: str, timeout_s: float, metrics: GatewayMetrics) -> RedisLimiter:
        from redis.asyncio import Redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the fallback answers at once; no retry loop
            health_check_interval=30,
        )
        kw = client.connection_pool.connection_kwargs
        where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        log.info("per-key limits in redis at %s, shared with every replica using it", where)
        return cls(client, metrics, where=f"redis at {where}")

    def _keys(self, key: Limited) -> list[str]:
        base = f"{self.prefix}{{{key.name}}}:"  # {name}: one hash slot in a Redis Cluster
        budget = key.budget
        if budget is None:
            return [base + "requests", base + "tokens", base + "budget"]
        ends = int(period_end(self.wall(), budget.period))
        return [base + "requests", base + "tokens", f"{base}budget:{budget.period}:{ends}"]

    def _failed(self, op: str, e: Exception) -> None:
        self.metrics.redis_errors.labels(op).inc()
        self._up.set(0)
        self._down_until = time.monotonic() + REDIS_RETRY_S
        if not self._down:
            self._down = True
            log.warning(
                "%s unreachable (%s: %s): per-key limits are this replica's own until it"
                " answers again (retried every %.0f s)",
                self.where,
                type(e).__name__,
                e,
                REDIS_RETRY_S,
            )

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            self._up.set(1)
            log.warning("%s answers again: per-key limits are shared again", self.where)

    async def admit(self, key: Limited, tokens: int) -> None:
        if key.requests is None and key.tokens is None and key.budget is None:
            return
        if time.monotonic() < self._down_until:
            return self.fallback.check(key, tokens)
        budget = key.budget
        wall = self.wall()
        ends = period_end(wall, budget.period) if budget is not None else 0.0
        args = [
            int(key.requests.capacity) if key.requests else 0,
            int(key.tokens.capacity) if key.tokens else 0,
            tokens,
            budget.tokens if budget else 0,
            int(ends * 1000) + 3_600_000,  # an hour past the period's end
            "" if self.clock is None else repr(self.clock()),
            BUCKET_TTL_MS,
        ]
        try:
            got = await self._admit(keys=self._keys(key), args=args)
        except Exception as e:  # redis.RedisError, OSError, asyncio.TimeoutError
            self._failed("admit", e)
            return self.fallback.check(key, tokens)
        self._recovered()
        status = int(got[0])
        if status == 1:
            what, limit, wait, level = (_text(v) for v in got[1:5])
            raise rate_limited(what, float(limit), float(wait), float(level))
        if status == 2:
            assert budget is not None
            used = float(_text(got[1]))
            raise budget_exhausted(key.name, budget.tokens, budget.period, used, ends, tokens, wall)

    def refund(self, key: Limited, tokens: int) -> None:
        if tokens <= 0 or (key.tokens is None and key.budget is None):
            return
        if time.monotonic() < self._down_until:
            return self.fallback.refund(key, tokens)
        task = asyncio.get_running_loop().create_task(self._send_refund(key, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_refund(self, key: Limited, tokens: int) -> None:
        _, bucket, budget = self._keys(key)
        args = [int(key.tokens.capacity) if key.tokens else 0, tokens]
        try:
            await self._refund(keys=[bucket, budget], args=args)
        except Exception as e:
            self._failed("refund", e)
            self.fallback.refund(key, tokens)

    async def settle(self) -> None:
        """Wait for the refunds on their way (tests; shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending))

    async def aclose(self) -> None:
        await self.settle()
        await self.client.aclose()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def limiter_for(
    redis_url: str | None, timeout_s: float, metrics: GatewayMetrics, memory: MemoryLimiter
) -> Limiter:
    """Redis when `redis_url` is set, else this process's own limits."""
    if not redis_url:
        return memory
    limiter = RedisLimiter.from_url(redis_url, timeout_s, metrics)
    limiter.fallback = memory
    return limiter
