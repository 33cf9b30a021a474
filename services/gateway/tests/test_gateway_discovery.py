"""Backends found by DNS (discovery.py): replicas of a headless Service, as a real DNS server
on loopback (lorastack_testing.dns_server) lists them, served by fake vLLMs on one port at
127.0.0.N (Linux routes all of 127/8 to loopback), as pods share a port at their own IPs.

The test decides when things happen: it changes the DNS table, then waits until the
gateway shows the change; open streams end when the test releases the fake's `hold`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_gateway_proxy import ADMIN, ADMIN_KEY, chat, metric, sse_events, wait_for

from gateway.backends import Backends
from gateway.discovery import DnsFollower, plan_membership
from gateway.main import create_app
from gateway.metrics import GatewayMetrics
from gateway.routing import BackendView
from gateway.settings import GatewaySettings
from gateway.tokens import TokenizerCache
from lorastack_testing.dns_server import DnsServer
from lorastack_testing.fake_state import FakeState
from lorastack_testing.fake_vllm import serve_fake
from lorastack_testing.net import free_port, serve_in_thread
from lorastack_testing.net import wait_for as wait_until

NAME = "inference.lorastack.svc.cluster.local"


class Replica:
    """A fake vLLM at 127.0.0.N:port, started and stopped by the test."""

    def __init__(self, n: int, port: int) -> None:
        self.ip = f"127.0.0.{n}"
        self.url = f"http://{self.ip}:{port}"
        self.port = port
        self.state = FakeState()
        self._serving: contextlib.ExitStack | None = None

    def start(self) -> Replica:
        stack = contextlib.ExitStack()
        stack.enter_context(serve_fake(self.state, self.port, host=self.ip))
        self._serving = stack
        return self

    def stop(self) -> None:
        """As its server stops at SIGTERM: no new connection, open requests get 2 s."""
        if self._serving is not None:
            self._serving.close()
            self._serving = None


class Cluster:
    """The DNS server and the replicas, on one port."""

    def __init__(self, dns: DnsServer) -> None:
        self.dns = dns
        self.port = free_port()
        self.replicas = [Replica(n, self.port) for n in range(2, 8)]

    def publish(self, *replicas: Replica) -> None:
        """What the headless Service lists now (its ready pods)."""
        self.dns.records[NAME] = [r.ip for r in replicas]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with DnsServer() as dns:
        c = Cluster(dns)
        try:
            yield c
        finally:
            for r in c.replicas:
                if r.state.hold is not None:
                    r.state.hold.set()
                r.stop()


@pytest.fixture
def dns_gateway(embedded_model: Path, tmp_path: Path) -> Any:
    """`with dns_gateway(cluster) as url:` a gateway following the cluster's DNS."""

    @contextlib.contextmanager
    def start(c: Cluster, **overrides: Any) -> Iterator[str]:
        values: dict[str, Any] = {
            "home": tmp_path / "home",
            "backends_dns": f"{NAME}:{c.port}",
            "backends_dns_nameserver": c.dns.address,
            "backends_dns_interval_s": 0.05,
            "tokenizers": {"smollm2": str(embedded_model)},
            "scrape_interval_s": 0.05,
            "retry_backoff_s": 0.01,
            "admin_key": ADMIN_KEY,
        } | overrides
        app = create_app(GatewaySettings(**values))
        with serve_in_thread(app, free_port()) as url:
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, "gateway ready", 60)
            yield url

    return start


def backends_seen(gw: str) -> dict[str, str]:
    """Backend URL -> "up" or its error, as the gateway's admin /ready lists them."""
    return dict(httpx.get(f"{gw}/ready", headers=ADMIN).json()["backends"])


@contextlib.contextmanager
def open_stream(gw: str) -> Iterator[tuple[httpx.Response, Iterator[bytes], list[bytes]]]:
    """A streamed chat held open; yields (response, chunk iterator, chunks read so far)
    once its first token has arrived."""
    with httpx.stream("POST", f"{gw}/v1/chat/completions", json=chat(stream=True), timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        got = [next(chunks)]
        while b'"content"' not in b"".join(got):
            got.append(next(chunks))
        yield r, chunks, got


# --- plain data -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("found", "serving", "draining", "add", "drain", "resume"),
    [
        ({"a", "b"}, set(), set(), {"a", "b"}, set(), set()),  # first answer
        ({"a", "b"}, {"a", "b"}, set(), set(), set(), set()),  # nothing changed
        ({"a"}, {"a", "b"}, set(), set(), {"b"}, set()),  # b left
        ({"a", "b"}, {"a"}, {"b"}, set(), set(), {"b"}),  # b came back while draining
        (set(), {"a"}, {"b"}, set(), {"a"}, set()),  # no ready replica: drain all
    ],
)
def test_plan_membership(found, serving, draining, add, drain, resume) -> None:
    plan = plan_membership(frozenset(found), frozenset(serving), frozenset(draining))
    assert (plan.add, plan.drain, plan.resume) == (add, drain, resume)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"backends_dns": "inference:8000", "backends": ["http://a:8000"]}, "not both"),
        ({"backends_dns": "inference"}, "must be NAME:PORT"),
        ({"backends_dns": "inference:0"}, "must be NAME:PORT"),
        ({"backends_dns": "x:1", "backends_dns_nameserver": "dns.local"}, "must be IP[:PORT]"),
        ({"backends_dns": "x:1", "backend_max_num_seqs": {"http://a": 4}}, "serve_config"),
    ],
)
def test_dns_settings_refuse_what_cannot_work(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("[", r"\[")):
        GatewaySettings(**values)


def test_dns_settings_start_with_no_backend() -> None:
    s = GatewaySettings(backends_dns="inference:8000", backends_dns_nameserver="::1")
    assert s.backends == []


# --- over the wire --------------------------------------------------------------------
def test_a_backend_back_from_draining_is_routed_only_on_a_fresh_scrape(tmp_path: Path) -> None:
    """Issue 58: a draining backend is not scraped; one that came back was routed on the
    scrape from before it left (its models, KV cache and health) until the next refresh,
    though it may have restarted meanwhile. It is unknown until a scrape answers, as a
    new one is: the follower's round that resumes it scrapes it."""
    with DnsServer() as dns:
        replica = Replica(2, free_port()).start()
        try:
            asyncio.run(_drain_and_come_back(dns, replica, tmp_path))
        finally:
            replica.stop()


async def _drain_and_come_back(dns: DnsServer, replica: Replica, tmp_path: Path) -> None:
    url = replica.url
    settings = GatewaySettings(
        home=tmp_path / "home",
        backends_dns=f"{NAME}:{replica.port}",
        backends_dns_nameserver=dns.address,
    )
    metrics = GatewayMetrics()
    async with httpx.AsyncClient() as client:
        backends = Backends(settings, metrics, TokenizerCache(settings), client)
        follower = DnsFollower(settings, backends, metrics)

        async def publish(*ips: str) -> BackendView:
            dns.records[NAME] = list(ips)
            await follower.sync()
            (view,) = backends.views()
            return view

        view = await publish(replica.ip)
        assert view.healthy and view.models == {"smollm2"} and view.kv_usage == 0.0
        backends.inflight.add(url, 1)  # a request open on it: it drains, it is not forgotten
        assert not (await publish()).healthy  # draining
        # meanwhile its server restarted with another model, and its cache filled up
        replica.state.models = [{"id": "other", "max_model_len": 2048}]
        replica.state.kv_usage = 0.99
        view = await publish(replica.ip)
        assert view.healthy and view.models == {"other"} and view.kv_usage == 0.99
        # one that comes back down is not routed to on what it was before it left
        await publish()
        replica.stop()
        view = await publish(replica.ip)
        assert not view.healthy and view.models == frozenset()
        assert backends.states[url].error.startswith("ConnectError")


def test_replicas_appear_become_ready_drain_and_leave(dns_gateway, cluster) -> None:
    r2, r3 = cluster.replicas[:2]
    r2.start()
    cluster.publish(r2)
    with dns_gateway(cluster) as gw:
        assert backends_seen(gw) == {r2.url: "up"}
        # r3 is listed before it answers: known, not routed to
        cluster.publish(r2, r3)
        wait_for(lambda: r3.url in backends_seen(gw))
        assert backends_seen(gw)[r3.url] != "up"
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 200
        assert r3.state.calls() == []
        r3.start()
        wait_for(lambda: backends_seen(gw)[r3.url] == "up")
        assert metric(gw, "lorastack_gateway_backends_discovered_total") == 2

        # a stream open on r2 when r2 leaves: no new request goes there, the stream ends whole
        r2.state.hold = threading.Event()
        cluster.publish(r2)  # r2 alone (r3 leaves): the stream below is r2's
        wait_for(lambda: r3.url not in backends_seen(gw))
        with open_stream(gw) as (_, chunks, got):
            assert len(r2.state.calls()) == 2
            cluster.publish(r3)
            wait_for(lambda: metric(gw, "lorastack_gateway_backends_discovered_total") == 3)
            wait_for(lambda: backends_seen(gw).get(r3.url) == "up")
            assert metric(gw, "lorastack_gateway_backends_draining") == 1
            for _ in range(4):
                r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True))
                assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
            assert len(r2.state.calls()) == 2  # the draining one got none of them
            assert len(r3.state.calls()) == 4
            r2.state.hold.set()
            got.extend(chunks)
        events = sse_events(b"".join(got).decode())
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        # drained: forgotten, its series gone, its open stream counted
        wait_for(lambda: metric(gw, "lorastack_gateway_backends_removed_total") == 2)  # r3, r2
        assert metric(gw, "lorastack_gateway_drained_requests_total") == 1
        assert metric(gw, "lorastack_gateway_backends_draining") == 0
        assert backends_seen(gw) == {r3.url: "up"}
        text = httpx.get(f"{gw}/metrics").text
        assert r2.url not in text and r3.url in text


def test_a_replica_that_vanishes_mid_stream_is_reported_and_the_rest_keep_serving(
    dns_gateway, cluster
) -> None:
    r2, r3 = (r.start() for r in cluster.replicas[:2])
    cluster.publish(r2)
    with dns_gateway(cluster) as gw:
        r2.state.hold = threading.Event()
        with open_stream(gw) as (_, chunks, got):
            cluster.publish(r2, r3)
            wait_for(lambda: backends_seen(gw).get(r3.url) == "up")
            r2.state.die_after_tokens = 1  # its pod dies: the connection breaks ...
            r2.state.hold.set()
            got.extend(chunks)
        events = sse_events(b"".join(got).decode())
        assert events[-1]["error"]["code"] == "upstream_broken", events[-1]
        assert r2.url in events[-1]["error"]["message"]
        kind = {"backend": r2.url, "kind": "broken_stream"}
        assert metric(gw, "lorastack_gateway_upstream_errors_total", **kind) == 1
        r2.stop()  # ... and its server is gone, then its record
        cluster.publish(r3)
        for _ in range(4):
            r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True))
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        wait_for(lambda: backends_seen(gw) == {r3.url: "up"})
        assert metric(gw, "lorastack_gateway_backends_removed_total") == 1


def test_a_dns_outage_keeps_the_backends_and_no_record_drains_them(dns_gateway, cluster) -> None:
    r2 = cluster.replicas[0].start()
    cluster.publish(r2)
    with dns_gateway(cluster) as gw:
        cluster.dns.servfail = True
        wait_for(lambda: metric(gw, "lorastack_gateway_dns_lookup_errors_total") >= 2)
        assert backends_seen(gw) == {r2.url: "up"}
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 200
        cluster.dns.servfail = False
        cluster.publish()  # NXDOMAIN: no replica is ready
        wait_for(lambda: backends_seen(gw) == {})
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 503, r.text
        assert f"no replica found at {NAME}" in r.json()["error"]["message"]


class Load:
    """Clients streaming chats back to back until stopped; every outcome recorded."""

    def __init__(self, gw: str, clients: int) -> None:
        self.gw = gw
        self.stopping = threading.Event()
        self.statuses: list[int] = []
        self.cut: list[str] = []  # streams that ended without [DONE] or with an error event
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def _client(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stopping.is_set():
                r = client.post(f"{self.gw}/v1/chat/completions", json=chat(stream=True))
                self.statuses.append(r.status_code)
                events = sse_events(r.text) if r.status_code == 200 else []
                if r.status_code == 200 and (
                    events[-1:] != ["[DONE]"] or any("error" in e for e in events[:-1])
                ):
                    self.cut.append(r.text[-300:])

    def wait_more(self, n: int) -> None:
        """Until `n` more requests have ended."""
        target = len(self.statuses) + n
        wait_for(lambda: len(self.statuses) >= target)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)


def test_scale_2_to_6_to_2_under_load_no_5xx_no_stream_cut(dns_gateway, cluster) -> None:
    replicas = [r.start() for r in cluster.replicas]
    for r in replicas:
        r.state.pace_s = 0.01  # a stream lasts some 60 ms: several overlap each change
    first, extra = replicas[:2], replicas[2:]
    cluster.publish(*first)

    with dns_gateway(cluster) as gw, Load(gw, clients=3) as load:
        load.wait_more(10)
        cluster.publish(*replicas)  # scale up
        wait_for(lambda: metric(gw, "lorastack_gateway_backend_up") == 6)
        load.wait_more(30)
        assert sum(len(r.state.calls()) for r in extra) > 0  # the new replicas took work
        cluster.publish(*first)  # scale down: the four leave the Service ...
        wait_for(lambda: metric(gw, "lorastack_gateway_backends_removed_total") == 4)
        taken = [len(r.state.calls()) for r in extra]
        for r in extra:  # ... and only then get SIGTERM (the preStop delay)
            wait_for(lambda r=r: r.state.active == 0)  # its last stream's end, on its side
            r.stop()
        load.wait_more(10)
        assert [len(r.state.calls()) for r in extra] == taken
        assert metric(gw, "lorastack_gateway_backend_up") == 2
    assert load.statuses and all(s == 200 for s in load.statuses), sorted(set(load.statuses))
    assert load.cut == []
