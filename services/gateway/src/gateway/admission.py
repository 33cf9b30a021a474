"""Admission: a request goes to a backend once its KV claim fits there, or waits in line.

Owns: the wait for KV-cache room (bounded by `kv_admit_wait_s`, first come first served,
across every worker of `--workers N`: the line is the in-flight counter's), the second
look at the backends before refusing a saturated one, and the call to the upstream with
the pick and the claim. Does not own: scoring (`routing.py`), the counts
(`routing.InflightCounter`, `shared_claims.SharedInflight`), retries (`upstream.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from gateway.backends import Backends
from gateway.errors import NoKvRoom, Overloaded
from gateway.routing import RouteRequest, Thresholds, Weights, kv_claim, pick_backend
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

        A request with no KV-cache room anywhere waits up to `kv_admit_wait_s` in the
        line of such requests (`InflightCounter`, or across workers `SharedInflight`), first
        come first served; one that arrives while others wait joins the line without looking
        for room."""
        interval = self.settings.scrape_interval_s
        line = self.backends.inflight
        wait_s = self.settings.kv_admit_wait_s
        # a request with no claim takes no room the line waits for: it never joins
        turn = line.join() if line.waiting and wait_s > 0 and route_req.sequences else None

        def route(tried: Collection[str]) -> str:
            return pick_backend(
                route_req,
                self.backends.views(),
                thresholds=self.thresholds,
                weights=self.weights,
                avoid=tried,
                retry_after_s=interval,
            )

        choice = ""  # routed before the upstream takes the count's lock (`route` scores
        # every backend: under a lock all workers share, it would hold them up)

        def pick(tried: Collection[str]) -> str:
            """Under the count's lock: the choice made without it while its claim still
            fits there, else routing again on the exact counts."""
            nonlocal turn
            fits = choice not in tried and self.backends.still_fits(route_req, choice)
            url = choice if fits else route(tried)
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
                if turn is None or line.is_head(turn):
                    try:
                        choice = route(())
                        return await self.upstream.open(pick, path, body, headers, claim)
                    except NoKvRoom:
                        # no KV room anywhere yet: wait for a request to end (bounded), then
                        # look again; vLLM would have queued it too, but could evict another
                        if loop.time() >= deadline:
                            raise
                        if turn is None:
                            turn = line.join()
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
                if left <= 0:  # still behind others
                    raise NoKvRoom(
                        f"requests that came earlier still wait for KV-cache room after"
                        f" {wait_s:g} s",
                        "retry after the Retry-After delay, lower max_tokens, or add replicas",
                        retry_after_s=interval,
                    )
                await line.next_turn(turn, left)
        finally:
            if turn is not None:
                line.leave(turn)
