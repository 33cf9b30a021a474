"""Per-key limits held in Redis: `RedisLimiter`, one atomic Lua script per admission, for
every gateway replica that names the same `redis_url` (the contract, the arithmetic's
meaning, the refusals and `MemoryLimiter`, its fallback, are `gateway.limits`).

Redis unreachable (refused, timed out, any Redis error): the request is checked against
this process's own buckets instead, logged once per outage, counted in
`lorastack_gateway_redis_errors_total`, and `lorastack_gateway_redis_up{redis}` reads 0;
Redis is tried again `REDIS_RETRY_S` later. A request admitted by the fallback is refunded
to it, never to Redis (which never charged it); a refund of a request Redis admitted goes
to the budget counter of the period it was charged to, and is dropped while Redis is down
(the key is then charged a little more than it used, never less).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.keys import period_end
from gateway.limits import Limited, MemoryLimiter, Reservation, budget_exhausted, rate_limited
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

REDIS_RETRY_S = 1.0  # after a Redis failure, this process's own limits for this long
BUCKET_TTL_MS = 120_000  # a bucket untouched this long is full again: Redis may drop it


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
        now: Callable[[], float] = time.monotonic,  # when Redis is tried again (tests: fake)
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.prefix = prefix
        self.fallback = fallback or MemoryLimiter(wall=wall)
        self.clock = clock
        self.wall = wall
        self.where = where  # for log lines; never holds a password
        self._now = now
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
    def from_url(
        cls,
        url: str,
        timeout_s: float,
        metrics: GatewayMetrics,
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> RedisLimiter:
        """A limiter on the Redis at `url`: `timeout_s` seconds a command, no retries."""
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
        return cls(client, metrics, where=f"redis at {where}", now=now)

    def _keys(self, key: Limited, ends: float) -> list[str]:
        """The key's requests and tokens buckets, and its budget counter of the period
        that ends at `ends` (epoch seconds)."""
        base = f"{self.prefix}{{{key.name}}}:"  # {name}: one hash slot in a Redis Cluster
        budget = key.budget
        if budget is None:
            return [base + "requests", base + "tokens", base + "budget"]
        return [base + "requests", base + "tokens", f"{base}budget:{budget.period}:{int(ends)}"]

    def _failed(self, op: str, e: Exception) -> None:
        self.metrics.redis_errors.labels(op).inc()
        self._up.set(0)
        self._down_until = self._now() + REDIS_RETRY_S
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

    async def admit(self, key: Limited, tokens: int) -> Reservation:
        """Take one request and `tokens` from the key's limits in Redis, or in this process while
        Redis is down.

        Raises RateLimited or BudgetExhausted with nothing taken."""
        if key.requests is None and key.tokens is None and key.budget is None:
            return Reservation(key, self)
        if self._now() < self._down_until:
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
            got = await self._admit(keys=self._keys(key, ends), args=args)
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
        return Reservation(key, self, ends)

    def refund(self, held: Reservation, tokens: int) -> None:
        """Give back unused `tokens` in the background, to whichever limiter admitted the request;
        dropped while Redis is down."""
        if held.limiter is not self:  # admitted by the fallback during an outage
            return held.limiter.refund(held, tokens)
        key = held.key
        if tokens <= 0 or (key.tokens is None and key.budget is None):
            return
        if self._now() < self._down_until:
            return  # Redis charged it and is down: dropped
        task = asyncio.get_running_loop().create_task(self._send_refund(held, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_refund(self, held: Reservation, tokens: int) -> None:
        key = held.key
        _, bucket, budget = self._keys(key, held.period_end)  # the period it was charged to
        args = [int(key.tokens.capacity) if key.tokens else 0, tokens]
        try:
            await self._refund(keys=[bucket, budget], args=args)
        except Exception as e:  # dropped, as while Redis is down
            self._failed("refund", e)

    async def settle(self) -> None:
        """Wait for the refunds on their way (tests; shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending))

    async def aclose(self) -> None:
        """Wait for pending refunds, then close the Redis client."""
        await self.settle()
        await self.client.aclose()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
