"""API keys, what each may use, and its limits, budget and usage.

Keys come from settings (`api_keys`), a plain secrets file (`api_keys_file`, one key per
line) and/or the keys file (`keys_file`, `keys.py`: names, allowed models, limits and a
token budget per key, hashed at rest). A key is known to the rest of the gateway only as
a `Key`: its name, an alias the operator chose (a keys-file name, or ALIAS in an
`ALIAS=KEY` entry of the plain lists) or else `key-N` by its place in the plain lists;
never the secret nor anything computed from it (a hash prefix in /metrics would let
anyone who reads it test guesses of a weak key), and the secret is never logged.

Lookup is one dict access by the secret's sha256 digest (O(1) in the number of keys; the
digest hides the secret, so the lookup's timing tells nothing useful). The keys file is
read at most once a second, on a request, and its keys replaced when its content's sha256
changes; a bad file is logged once and the keys in force stay. Content, not (mtime, size):
a same-length rewrite within one tick of a coarse file clock (or through a bind mount)
changes neither, and would keep a revoked secret valid; inode and ctime miss an in-place
rewrite within one tick too. Reading and hashing the file once a second is cheap: about
20 µs for 100 keys (12 KB), 0.9 ms for 10,000 (1.2 MB). Limits are token buckets that refill
continuously: requests per minute, and tokens per minute (prompt + max_tokens reserved
at admission, the unused part refunded when the backend reports its usage). A budget is
tokens per calendar period (UTC), reserved and refunded the same way. Where they are
counted is the limiter's (`limits.py`): in this process (state survives a reload, by
name, not a restart), or in Redis (`redis_url`: shared by every replica, kept across
restarts; `limiter_for` picks, and imports `redis_limits` only then).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.errors import ModelNotAllowed, RateLimited, Unauthorized
from gateway.keys import KeyEntry, load_keys
from gateway.limits import (
    Budget,
    Limiter,
    MemoryLimiter,
    Reservation,
    TokenBucket,
    WorkerShare,
)
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.settings_parsing import split_alias
from lorastack.errors import ConfigError
from lorastack.secrets import API_KEY_MIN_CHARS, secret_problem

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0  # seconds between two reads of the keys file


def bearer_matches(key: str | None, authorization: str | None) -> bool:
    """True when `authorization` is `Bearer KEY` (the admin or metrics key); never without
    a key set (settings refuse an empty one). Digests compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    if key is None or scheme.lower() != "bearer" or not token.strip():
        return False
    given = hashlib.sha256(token.strip().encode()).digest()
    return hmac.compare_digest(given, hashlib.sha256(key.encode()).digest())


def key_names(entries: list[str]) -> list[tuple[str, str]]:
    """(name, secret) of each plain-list entry: its alias, else `key-N` (1-based place)."""
    out = []
    for n, entry in enumerate(entries, 1):
        alias, secret = split_alias(entry)
        out.append((alias or f"key-{n}", secret))
    return out


def read_keys_file(path: Path) -> list[str]:
    """The keys listed in `path`, one a line; blank lines and `#` comments skipped."""
    lines = path.read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


@dataclass
class Key:
    """One API key as the gateway knows it (never the secret)."""

    name: str
    models: frozenset[str] | None  # None: every model
    requests: TokenBucket | None
    tokens: TokenBucket | None
    budget: Budget | None
    usage: dict[str, Any] = field(default_factory=dict)  # metric children, bound once

    def may_use(self, model: str) -> bool:
        """Whether this key may use `model`."""
        return self.models is None or model in self.models

    def carry_from(self, old: Key) -> None:
        """Keep what `old` (the same name, before a reload) used."""
        for mine, theirs in ((self.requests, old.requests), (self.tokens, old.tokens)):
            if mine is not None and theirs is not None and theirs.level >= 0:
                mine.level, mine.stamp = min(mine.capacity, theirs.level), theirs.stamp
        if self.budget and old.budget and self.budget.period == old.budget.period:
            self.budget.used, self.budget.resets_at = old.budget.used, old.budget.resets_at


class Authenticator:
    """Checks API keys (static ones and the keys file) and applies each key's models, rate
    limits and budget through `limiter`; counts usage and rejections per key."""

    def __init__(
        self,
        enabled: bool,
        secrets: list[str],
        *,
        keys_file: Path | None = None,
        requests_per_min: int = 0,
        tokens_per_min: int = 0,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        limiter: Limiter | None = None,
    ) -> None:
        self.enabled = enabled
        self.requests_per_min = requests_per_min  # defaults for keys that set none
        self.tokens_per_min = tokens_per_min
        self.metrics = metrics or GatewayMetrics()
        self.clock = clock
        self.wall = wall
        # this process's own limits: the limiter, or the Redis limiter's fallback
        self.memory = MemoryLimiter(lambda: self.clock(), lambda: self.wall())
        self.limiter: Limiter = limiter or self.memory
        self.keys_file = keys_file
        self._static = {
            hashlib.sha256(secret.encode()).digest(): self._key(name)
            for name, secret in key_names([s for s in secrets if s])
        }
        self._by_digest: dict[bytes, Key] = dict(self._static)
        self._file_digest: bytes | None = None  # sha256 of the keys file's content in force
        self._next_check = 0.0
        self.anonymous = self._key("anonymous")
        if keys_file is not None:
            self._load(keys_file.read_bytes())  # a bad file at start is a ConfigError

    @classmethod
    def from_settings(cls, s: GatewaySettings, metrics: GatewayMetrics) -> Authenticator:
        """The authenticator the settings describe, its limiter in Redis when `redis_url` is set.

        Raises ConfigError when a line of `api_keys_file` is not a real key."""
        raw = [k.get_secret_value() for k in s.api_keys]
        if s.api_keys_file is not None:
            listed = read_keys_file(s.api_keys_file)
            for n, entry in enumerate(listed, 1):
                where = f"key {n} of api_keys_file"
                if why := secret_problem(split_alias(entry)[1], where, API_KEY_MIN_CHARS):
                    raise ConfigError(f"{s.api_keys_file}: {why}", "write one real key a line")
            raw += listed
        auth = cls(
            s.auth_required,
            raw,
            keys_file=s.keys_file,
            requests_per_min=s.key_requests_per_min,
            tokens_per_min=s.key_tokens_per_min,
            metrics=metrics,
        )
        url = s.redis_url.get_secret_value() if s.redis_url is not None else None
        auth.limiter = limiter_for(url, s.redis_timeout_s, metrics, auth.memory, s.workers)
        return auth

    # --- keys --------------------------------------------------------------------
    def _key(self, name: str, entry: KeyEntry | None = None) -> Key:
        rpm = (entry.requests_per_min if entry else 0) or self.requests_per_min
        tpm = (entry.tokens_per_min if entry else 0) or self.tokens_per_min
        budget = entry.budget_tokens if entry else 0
        m = self.metrics
        return Key(
            name,
            frozenset(entry.models) if entry and entry.models is not None else None,
            TokenBucket(rpm) if rpm else None,
            TokenBucket(tpm) if tpm else None,
            Budget(budget, entry.budget_period) if entry and budget else None,
            {
                "requests": m.key_requests.labels(name),
                "prompt": m.key_prompt_tokens.labels(name),
                "completion": m.key_completion_tokens.labels(name),
            },
        )

    def _load(self, content: bytes) -> None:
        assert self.keys_file is not None
        self._file_digest = hashlib.sha256(content).digest()  # a bad file: reported once
        entries = load_keys(self.keys_file, content).keys
        old = {k.name: k for k in self._by_digest.values()}
        table = dict(self._static)
        for e in entries:
            key = self._key(e.name, e)
            if e.name in old:
                key.carry_from(old[e.name])
            table[bytes.fromhex(e.sha256)] = key
        self._by_digest = table

    def _maybe_reload(self) -> None:
        now = self.clock()
        if self.keys_file is None or now < self._next_check:
            return
        self._next_check = now + RELOAD_CHECK_S
        # a file that cannot be used leaves the keys in force, said once per change
        try:
            content = self.keys_file.read_bytes()
        except OSError as e:
            if self._file_digest is not None:
                log.error("keys file %s unreadable, the previous keys stay: %s", self.keys_file, e)
            self._file_digest = None
            return
        if hashlib.sha256(content).digest() == self._file_digest:
            return
        try:
            self._load(content)
        except ConfigError as e:
            log.error("keys file %s not reloaded, the previous keys stay: %s", self.keys_file, e)
            return
        log.info("keys file %s reloaded: %d keys", self.keys_file, len(self._by_digest))

    def names(self) -> list[str]:
        """The names of the keys in force, sorted."""
        return sorted(k.name for k in self._by_digest.values())

    # --- per request -------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Key:
        """The caller's Key; `anonymous` when auth is off. Raises Unauthorized."""
        if not self.enabled:
            return self.anonymous
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized(
                "missing API key", "send the header `Authorization: Bearer YOUR_KEY`"
            )
        self._maybe_reload()
        key = self._by_digest.get(hashlib.sha256(token.strip().encode()).digest())
        if key is None:
            raise Unauthorized("invalid API key", "check the key you were given")
        return key

    def check_model(self, key: Key, model: str) -> None:
        """Raise ModelNotAllowed unless `key` may use `model`."""
        if not key.may_use(model):
            allowed = ", ".join(sorted(key.models or ())) or "none"
            raise ModelNotAllowed(
                f"the key {key.name!r} may not use the model `{model}`; it may use: {allowed}",
                "use one of those models, or ask for the key's models to be extended",
                param="model",
            )

    async def admit(self, key: Key, tokens: int) -> Reservation:
        """Take one request and `tokens` from the key's buckets and budget, or raise
        RateLimited / BudgetExhausted (nothing taken then). The reservation is what
        `refund` gives back to."""
        if key.tokens is not None and tokens > key.tokens.capacity:
            raise RateLimited(
                f"this request needs {tokens} tokens (prompt + max_tokens) but your key may"
                f" use at most {int(key.tokens.capacity)} tokens per minute",
                "lower max_tokens or shorten the prompt",
                retry_after_s=60,
            )
        held = await self.limiter.admit(key, tokens)
        key.usage["requests"].inc()
        return held

    def refund(self, held: Reservation, tokens: int) -> None:
        """Give back reserved tokens the request did not use, to what admitted them."""
        self.limiter.refund(held, tokens)

    def record_usage(self, key: Key, prompt: int, completion: int) -> None:
        """Add a request's prompt and completion tokens to the key's usage counters."""
        key.usage["prompt"].inc(prompt)
        key.usage["completion"].inc(completion)

    def rejected(self, key: Key, reason: str) -> None:
        """Count a rejection of `key` for `reason` (lorastack_gateway_key_rejections_total)."""
        self.metrics.key_rejections.labels(key.name, reason).inc()


def limiter_for(
    redis_url: str | None,
    timeout_s: float,
    metrics: GatewayMetrics,
    memory: MemoryLimiter,
    workers: int = 1,
) -> Limiter:
    """Redis when `redis_url` is set, else this process's own limits. While Redis is
    down: this process's own limits, or with `workers` > 1 this worker's share of them
    (`WorkerShare`), so that N workers do not give a key N times its limit."""
    if not redis_url:
        return memory
    from gateway.redis_limits import RedisLimiter  # redis is imported only when configured

    limiter = RedisLimiter.from_url(redis_url, timeout_s, metrics)
    if workers > 1:
        limiter.fallback = WorkerShare(workers, memory.clock, memory.wall)
    else:
        limiter.fallback = memory
    return limiter
