"""API keys and per-key limits.

Keys come from settings (`api_keys`) and/or a secrets file (one key per line). They are
compared in constant time and never logged: a key is known to the rest of the gateway
only by `key_id`, the first 12 hex digits of its sha256. Limits are token buckets that
refill continuously: requests per minute, and tokens per minute (prompt + max_tokens
reserved at admission, the unused part refunded when the backend reports its usage).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import RateLimited, Unauthorized
from gateway.settings import GatewaySettings


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def read_keys_file(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


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
class KeyLimits:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass
class Authenticator:
    enabled: bool
    keys: list[bytes]  # sha256 digests of the valid keys
    requests_per_min: int = 0
    tokens_per_min: int = 0
    clock: Callable[[], float] = time.monotonic
    _limits: dict[str, KeyLimits] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: GatewaySettings) -> Authenticator:
        raw = [k.get_secret_value() for k in s.api_keys]
        if s.api_keys_file is not None:
            raw += read_keys_file(s.api_keys_file)
        digests = [hashlib.sha256(k.encode()).digest() for k in raw if k]
        return cls(s.auth_enabled, digests, s.key_requests_per_min, s.key_tokens_per_min)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key_id; "anonymous" when auth is off. Raises Unauthorized."""
        if not self.enabled:
            return "anonymous"
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized(
                "missing API key", "send the header `Authorization: Bearer YOUR_KEY`"
            )
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for known in self.keys:  # compare with every key, in constant time each
            ok |= hmac.compare_digest(digest, known)
        if not ok:
            raise Unauthorized("invalid API key", "check the key you were given")
        return key_id(token.strip())

    def _for(self, kid: str) -> KeyLimits:
        if kid not in self._limits:
            self._limits[kid] = KeyLimits(
                TokenBucket(self.requests_per_min) if self.requests_per_min else None,
                TokenBucket(self.tokens_per_min) if self.tokens_per_min else None,
            )
        return self._limits[kid]

    def admit(self, kid: str, tokens: int) -> None:
        """Take one request and `tokens` from the key's buckets, or raise RateLimited."""
        lim = self._for(kid)
        now = self.clock()
        if lim.tokens is not None and tokens > lim.tokens.capacity:
            raise RateLimited(
                f"this request needs {tokens} tokens (prompt + max_tokens) but your key may"
                f" use at most {int(lim.tokens.capacity)} tokens per minute",
                "lower max_tokens or shorten the prompt",
                retry_after_s=60,
            )
        waits = []
        if lim.requests is not None:
            waits.append(("requests", self.requests_per_min, lim.requests.wait_s(1, now)))
        if lim.tokens is not None:
            waits.append(("tokens", self.tokens_per_min, lim.tokens.wait_s(tokens, now)))
        blocked = [(what, limit, w) for what, limit, w in waits if w > 0]
        if blocked:
            what, limit, wait = max(blocked, key=lambda b: b[2])
            raise RateLimited(
                f"rate limit reached: {limit} {what} per minute for this key",
                f"retry in {wait:.1f} s",
                retry_after_s=wait,
            )
        if lim.requests is not None:
            lim.requests.take(1, now)
        if lim.tokens is not None:
            lim.tokens.take(tokens, now)

    def refund(self, kid: str, tokens: int) -> None:
        """Give back reserved tokens the request did not use."""
        lim = self._limits.get(kid)
        if lim is not None and lim.tokens is not None and tokens > 0:
            lim.tokens.give_back(tokens)
