"""Backends found by DNS: the replicas behind a headless Service, followed as they come and go.

Kubernetes publishes a headless Service (`clusterIP: None`) as one A record per *ready* pod
(`publishNotReadyAddresses` is false by default): a pod whose readiness probe fails, or
that is being deleted, leaves the answer. Every `backends_dns_interval_s` the follower
looks the name up and compares the addresses with the backends it knows
(`plan_membership`):

    appeared   added, and scraped at once; routed to once its /v1/models and /metrics
               answer (as a static backend is)
    gone       drained: routing sends it nothing new, its open requests finish on their
               own connections, and once none is open it is forgotten (its metric series
               too, so sums over backends count only the live ones)
    back       a draining backend that reappears (its readiness flapped) serves again

A failed lookup (timeout, SERVFAIL) changes nothing: a DNS outage must not empty the
gateway. An answer without addresses (NXDOMAIN, no A record) means no replica is ready,
and drains them all.

Why DNS and not the EndpointSlice API: no RBAC, no Kubernetes client and no service
account token in the gateway pod (automountServiceAccountToken stays false), and the same
setting follows any DNS that lists replicas (compose's `--scale` gives several A records).
The price: a pod's leaving is seen up to one interval late, which the inference pod's
preStop delay covers (docs/scaling.md).

Owns: the lookup, the membership plan, the discovery metrics. The app builds the
follower and runs it beside the backends' refresh (main.py's lifespan).
Does not own: scraping and the backends' state, which only `Backends.add`, `drain`,
`resume` and `forget` change (backends.py); a forgotten backend's metric series
(`GatewayMetrics.forget_backend`); routing (routing.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import NamedTuple

import dns.asyncresolver
import dns.exception
import dns.resolver
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.backends import Backends
from gateway.metrics import GatewayMetrics
from gateway.serve_config import served_max_num_seqs
from gateway.settings import GatewaySettings
from gateway.settings_parsing import dns_target, nameserver

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0  # seconds, all tries of one lookup together


class MembershipPlan(NamedTuple):
    """What one DNS lookup changes in the backend set: backends to add, drain and resume."""

    add: frozenset[str]  # found, not known: add
    drain: frozenset[str]  # serving, no longer found: stop routing to it
    resume: frozenset[str]  # draining, found again: route to it again


def plan_membership(
    found: frozenset[str], serving: frozenset[str], draining: frozenset[str]
) -> MembershipPlan:
    """What to change so the backends follow what DNS `found` (backend URLs)."""
    return MembershipPlan(
        add=found - serving - draining, drain=serving - found, resume=found & draining
    )


def make_resolver(server: str | None) -> dns.asyncresolver.Resolver:
    """dnspython's resolver: the system's (/etc/resolv.conf, with its search domains and
    ndots), or one that asks only `server` (IP[:PORT])."""
    if server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, port = nameserver(server)
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    resolver.lifetime = LOOKUP_TIMEOUT_S
    return resolver


class DiscoveryMetrics(Collector):
    """The follower's metrics, in the gateway's registry: the membership counters read from
    the in-flight counts (`Membership`: each event once, with any number of workers), and
    this worker's failed lookups."""

    def __init__(self, metrics: GatewayMetrics, backends: Backends) -> None:
        self.backends = backends
        # each worker looks the name up itself: each failed lookup is one of its own
        self.lookup_errors = Counter(
            "lorastack_gateway_dns_lookup_errors_total",
            "lookups of backends_dns that failed (the backends stayed as they were)",
            registry=metrics.registry,
        )
        metrics.add_collector(self)

    def collect(self) -> Iterator[Metric]:
        m = self.backends.inflight.membership()
        yield CounterMetricFamily(
            "lorastack_gateway_backends_discovered",
            "backends that appeared in backends_dns and were added",
            value=m.discovered,
        )
        yield CounterMetricFamily(
            "lorastack_gateway_backends_removed",
            "backends that left backends_dns and were forgotten once drained",
            value=m.removed,
        )
        yield GaugeMetricFamily(
            "lorastack_gateway_backends_draining",
            "backends that left backends_dns with requests still open on them",
            value=m.draining,
        )
        yield CounterMetricFamily(
            "lorastack_gateway_drained_requests",
            "requests open on a backend when it left backends_dns, let finish on it (one"
            " its replica broke off is also in lorastack_gateway_upstream_errors_total)",
            value=m.drained_requests,
        )


class DnsFollower:
    """Keeps `backends` equal to the A records of `backends_dns`, draining the ones that go."""

    def __init__(
        self,
        settings: GatewaySettings,
        backends: Backends,
        metrics: GatewayMetrics,
        resolver: dns.asyncresolver.Resolver | None = None,
    ) -> None:
        assert settings.backends_dns is not None
        self.name, self.port = dns_target(settings.backends_dns)
        self.interval_s = settings.backends_dns_interval_s
        self.backends = backends
        self.counts = DiscoveryMetrics(metrics, backends)
        self.resolver = resolver or make_resolver(settings.backends_dns_nameserver)
        # every replica runs the same serve config: its running slots hold for each
        self.max_num_seqs = (
            served_max_num_seqs(settings.serve_config) if settings.serve_config else None
        )

    async def lookup(self) -> frozenset[str] | None:
        """Backend URLs the name resolves to now; None when the lookup failed."""
        try:
            answer = await self.resolver.resolve(self.name, "A", search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return frozenset()  # no ready replica
        except dns.exception.DNSException as e:
            self.counts.lookup_errors.inc()
            log.warning("lookup of %s failed (backends kept as they are): %s", self.name, e)
            return None
        return frozenset(f"http://{rr.to_text()}:{self.port}" for rr in answer)

    async def sync(self) -> None:
        """One round: look up, then add, drain, resume and forget as the answer says."""
        found = await self.lookup()
        if found is not None:
            states = self.backends.states
            draining = frozenset(u for u, st in states.items() if st.draining)
            plan = plan_membership(found, frozenset(states) - draining, draining)
            for url in sorted(plan.resume):
                log.info("backend %s is back in %s", url, self.name)
            for url in sorted(plan.drain):
                open_requests = self.backends.drain(url)
                log.info("backend %s left %s: draining (%d open)", url, self.name, open_requests)
            added = sorted(plan.add)
            for url in added:
                log.info("backend %s found in %s", url, self.name)
            await asyncio.gather(
                *(self.backends.resume(u) for u in sorted(plan.resume)),  # scraped afresh
                *(self.backends.add(u, self.max_num_seqs) for u in added),
            )
        self.forget_drained()

    def forget_drained(self) -> None:
        """Forget draining backends that have nothing open any more."""
        for url in self.backends.drained():
            self.backends.forget(url)
            log.info("backend %s drained and forgotten", url)

    async def run(self) -> None:
        """Look up every interval until cancelled (one failed round does not stop it)."""
        while True:
            try:
                await self.sync()
            except Exception:
                log.exception("following %s failed this round", self.name)
            await asyncio.sleep(self.interval_s)
