"""Admission: a request goes to a backend once its KV claim fits there, or waits in line.

Owns: the wait for KV-cache room (bounded by `kv_admit_wait_s`, first come first served
on each backend, across every worker of `--workers N`: the lines are the claims'), the
second look at the backends before refusing a saturated one, and the call to the
upstream with the pick and the claim. Does not own: scoring (`routing.py`), the counts
and lines (`claims.Claims`: `claims.InflightCounter`, `shared_claims.SharedInflight`),
retries (`upstream.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from gateway.backends import Backends
from gateway.claims import Turn
from gateway.errors import NoKvRoom, Overloaded
from gateway.routing import (
    RouteRequest,
    Thresholds,
    Weights,
    candidates,
    kv_claim,
    pick_backend,
)
from gateway.settings import GatewaySettings
from gateway.upstream import Upstream, UpstreamCall


class Admission:
    """Sends an admitted request to the backend routing picks: admission control, retries."""

    def __init__(
        self,
        settings: GatewaySettings,
        backends: Backends,
        upstream: Upstream,
        thresholds: Thresholds,
        weights: Weights,
    ) -> None:
        self.settings = settings
        self.backends = backends
        self.upstream = upstream
        self.thresholds = thresholds
        self.weights = weights

    async def open(self, route_req: RouteRequest, path: str, body: bytes, rid: str) -> UpstreamCall:
        """POST `body` to the backend routing picks (admission control, retries).

        A request with no KV-cache room on any backend that could take it waits up to
        `kv_admit_wait_s` in the line of each of those backends (`claims.Claims`), first
        come first served per backend: it never takes room on a backend where a request
        that came before it waits, and never waits for a backend it could not use."""
        interval = self.settings.scrape_interval_s
        line = self.backends.inflight
        wait_s = self.settings.kv_admit_wait_s
        # a request with no claim takes no room the lines wait for: it never joins one
        waits = wait_s > 0 and bool(route_req.sequences)
        turn: Turn | None = None
        blocked = line.blocked(None) if waits and line.waiting else frozenset()

        def route(tried: Collection[str], blocked: Collection[str]) -> str:
            return pick_backend(
                route_req,
                self.backends.views(),
                thresholds=self.thresholds,
                weights=self.weights,
                avoid=tried,
                blocked=blocked,
                retry_after_s=interval,
            )

        choice = ""  # routed before the upstream takes the count's lock (`route` scores
        # every backend: under a lock all workers share, it would hold them up)

        def pick(tried: Collection[str]) -> str:
            """Under the count's lock: the choice made without it while its claim still
            fits there and no earlier request waits there, else routing again on the
            exact counts."""
            nonlocal turn
            closed = line.blocked(turn) if waits else frozenset()
            fits = choice not in tried and choice not in closed
            fits = fits and self.backends.still_fits(route_req, choice)
            url = choice if fits else route(tried, closed)
            if turn is not None:  # admitted: the next in line looks once this claim counts
                line.leave(turn)  # (the upstream counts it before its first await)
                turn = None
            return url

        def claim(url: str) -> int:
            return kv_claim(route_req, self.backends.block_size(url))

        headers = {"content-type": "application/json", "x-request-id": rid}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        rescraped = False
        try:
            while True:
                try:
                    choice = route((), blocked)
                    return await self.upstream.open(pick, path, body, headers, claim)
                except NoKvRoom:
                    # no KV room yet: wait for a request to end (bounded), then look
                    # again; vLLM would have queued it too, but could evict another
                    if not waits or loop.time() >= deadline:
                        raise
                    if turn is None:
                        views = self.backends.views()
                        share = self.thresholds.kv_request_share
                        turn = line.join({v.url for v in candidates(route_req, views, share)})
                        blocked = line.blocked(turn)
                        continue  # in line: room given back from now on wakes it; look again
                except Overloaded:
                    # saturated by the last scrape, which may be up to scrape_interval_s
                    # old (a burst that has just ended still looks full): read the
                    # backends once more before refusing (refresh() shares one read
                    # at once; issue 39)
                    if rescraped:
                        raise
                    rescraped = True
                    await self.backends.refresh()
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    raise NoKvRoom(
                        f"no KV-cache room for this request after {wait_s:g} s in line",
                        "retry after the Retry-After delay, lower max_tokens, or add replicas",
                        retry_after_s=interval,
                    )
                await line.next_turn(turn, left, interval)
                blocked = line.blocked(turn)
        finally:
            if turn is not None:
                line.leave(turn)
