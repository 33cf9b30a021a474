"""Per-key limit accounting: requests and tokens per minute, and token budgets.

    Limiter                 admit(key, tokens) -> Reservation / refund(reservation, tokens)
    ├── MemoryLimiter       this process's own buckets (the state lives in each `Key`)
    └── RedisLimiter        one Lua script per admission in Redis, shared by every
                            gateway replica that names the same `redis_url`
                            (`gateway.redis_limits`)

Both keep the same semantics: token buckets that refill continuously (capacity = the
limit per minute, starting full), a budget of tokens per calendar period (UTC), checked
budget first, then both buckets; nothing is taken when anything refuses; the refusal
(`rate_limited`, `budget_exhausted`, here for both) names the limit that blocks longest
and when to retry. `gateway.errors` turns them into the same 429 body and headers.

A refund goes back to what the admission took, as its `Reservation` says: the limiter
that counted it (a Redis limiter's fallback, during an outage) and the budget period it
was charged to. A refund that arrives after that period ended gives the new period
nothing (it was never charged there); the tokens-per-minute bucket, which has no period,
takes it back.

Redis unreachable (refused, timed out, any Redis error): the request is checked against
this process's own buckets instead (fail open to per-replica limits, as LiteLLM's proxy
does when its Redis cache fails); with `--workers N`, against this worker's share of
them (`WorkerShare`: each limit / N), so the workers of one replica together stay within
the limit. A request is never refused, nor failed with a 500,
because Redis is down; `gateway.redis_limits` says how it is logged and counted.

Owns: the arithmetic and the in-process limiter. Does not own: which key a request is,
and its limits (`auth.py`, `keys.py`), nor which limiter runs (`auth.limiter_for` picks
Redis or this process's: `gateway.redis_limits` builds on this module, never the reverse).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import BudgetExhausted, RateLimited
from gateway.keys import Period, period_end


@dataclass
class TokenBucket:
    """A per-minute limit: `capacity` units a minute, refilled continuously."""

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
        """Take `amount` at `now` (the level may go below zero)."""
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float) -> None:
        """Return `amount` unused units, up to the capacity."""
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Budget:
    """A key's token budget: `tokens` per `period`, used so far, and when it resets."""

    tokens: int  # per period
    period: Period
    used: float = 0.0
    resets_at: float = 0.0  # epoch seconds; 0: not started

    def roll(self, now: float) -> None:
        """Start a new period, nothing used, once `now` (epoch seconds) reaches the reset."""
        if now >= self.resets_at:
            self.used, self.resets_at = 0.0, period_end(now, self.period)


class Limited(Protocol):
    """What a limiter needs of a key (`auth.Key`): its name and limits."""

    name: str
    requests: TokenBucket | None
    tokens: TokenBucket | None
    budget: Budget | None


@dataclass(frozen=True)
class Reservation:
    """What one admission took, so that its refund goes back there and nowhere else."""

    key: Limited
    limiter: Limiter  # the one that counted it
    period_end: float = 0.0  # epoch seconds: the end of the budget period charged; 0 = none


class Limiter(Protocol):
    """Where the per-key limits are counted: this process (`MemoryLimiter`) or Redis."""

    async def admit(self, key: Limited, tokens: int) -> Reservation:
        """Take one request and `tokens` from the key's limits, or raise RateLimited /
        BudgetExhausted (nothing taken then)."""

    def refund(self, held: Reservation, tokens: int) -> None:
        """Give back reserved tokens a request did not use (never raises, never waits)."""

    async def aclose(self) -> None:
        """Close what the limiter holds open (its Redis connection)."""


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
    """The BudgetExhausted error for a key: what is left, and when the budget resets."""
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

    def check(self, key: Limited, tokens: int) -> Reservation:
        """Take one request and `tokens` from the key's buckets and budget.

        Raises BudgetExhausted or RateLimited (the longest wait among the buckets) with nothing
        taken."""
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
        if budget is None:
            return Reservation(key, self)
        budget.used += tokens
        return Reservation(key, self, budget.resets_at)

    async def admit(self, key: Limited, tokens: int) -> Reservation:
        """`check`, as the `Limiter` protocol's coroutine."""
        return self.check(key, tokens)

    def refund(self, held: Reservation, tokens: int) -> None:
        """Give back `tokens` a request did not use to the key's bucket and, when still in the same
        period, its budget."""
        key = held.key
        if tokens <= 0:
            return
        if key.tokens is not None:
            key.tokens.give_back(tokens)
        budget = key.budget
        if budget is not None and budget.resets_at == held.period_end:  # else a past period
            budget.used = max(0.0, budget.used - tokens)

    async def aclose(self) -> None:
        """Nothing to close (the `Limiter` protocol's method)."""
        pass


@dataclass
class _Share:
    """One worker's share of a key's limits (`WorkerShare`): `Limited`, as a `Key` is."""

    name: str
    requests: TokenBucket | None
    tokens: TokenBucket | None
    budget: Budget | None


class WorkerShare(MemoryLimiter):
    """The limits of one of `workers` processes that count apart (`--workers N` while
    Redis is down): each key's limits per minute and budget divided by `workers`, so the
    workers together never admit more than the key's limit, however the kernel spreads
    the connections (a client on one kept-alive connection gets its worker's share)."""

    def __init__(
        self,
        workers: int,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock, wall)
        self.workers = workers
        self._shares: dict[str, tuple[Limited, _Share]] = {}  # key name -> (key, share)

    def check(self, key: Limited, tokens: int) -> Reservation:
        """`MemoryLimiter.check` against this worker's share of the key's limits."""
        return super().check(self._share(key), tokens)

    def _share(self, key: Limited) -> _Share:
        found = self._shares.get(key.name)
        if found is not None and found[0] is key:
            return found[1]
        n = self.workers  # a new key object: the keys file was read again, maybe new limits
        req, tok, budget = key.requests, key.tokens, key.budget
        share = _Share(
            key.name,
            requests=TokenBucket(req.capacity / n) if req is not None else None,
            tokens=TokenBucket(tok.capacity / n) if tok is not None else None,
            budget=Budget(budget.tokens // n, budget.period) if budget is not None else None,
        )
        self._shares[key.name] = (key, share)
        return share
