"""KV-cache admission that acts before vLLM preempts (issue 39): the gateway counts the
prompt + max output of what it has itself sent against the capacity vLLM reports in
`vllm:cache_config_info`, and answers 429 + Retry-After for what does not fit.

The pure check first (table-driven), claims in whole blocks per sequence, the metric
labels of vLLM 0.26 and 0.32, then the gateway against the fake vLLM with a tiny KV cache:
concurrent requests over capacity, the claim given back on completion, client disconnect
(streamed, unary, or still waiting in line) and upstream errors, batched prompts and
`n > 1` counted per sequence, and admission in order of arrival (issue 48)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from test_gateway_proxy import chat, metric, wait_for

from gateway.claims import InflightCounter
from gateway.errors import KvClaimTooLarge, NoKvRoom, Overloaded
from gateway.prepared import OutputPlan, kv_sequences
from gateway.routing import (
    BackendView,
    RouteRequest,
    Thresholds,
    fits_kv,
    kv_claim,
    pick_backend,
)
from gateway.scrape import parse_metrics

B = 16  # tokens per block


def view(**kw: Any) -> BackendView:
    base: dict[str, Any] = {"url": "a", "models": frozenset({"m"}), "block_size": B}
    return BackendView(**(base | kw))


# capacity 160 tokens = 10 blocks, one of them vLLM's null block: 144 usable. Claims are
# whole blocks (`inflight_tokens` is a sum of them).
@pytest.mark.parametrize(
    ("sequences", "v", "fits"),
    [
        ((100,), view(kv_capacity_tokens=None, inflight=50, inflight_tokens=10**6), True),
        ((10**6,), view(kv_capacity_tokens=160, inflight=0), True),  # alone: vLLM's to refuse
        ((80,), view(kv_capacity_tokens=160, inflight=1, inflight_tokens=64), True),  # 64+80
        ((81,), view(kv_capacity_tokens=160, inflight=1, inflight_tokens=64), False),  # 64+96
        ((40, 40), view(kv_capacity_tokens=160, inflight=1, inflight_tokens=64), False),  # 64+96
        ((1,), view(kv_capacity_tokens=160, inflight=9, inflight_tokens=144), False),
        ((), view(kv_capacity_tokens=160, inflight=9, inflight_tokens=999), True),  # no claim
    ],
)
def test_fits_kv(sequences: tuple[int, ...], v: BackendView, fits: bool) -> None:
    assert fits_kv(RouteRequest("m", sequences=sequences), v) is fits


@pytest.mark.parametrize(
    ("prompts", "max_tokens", "n", "claim"),
    [
        ([9] * 8, 8, 1, 8 * 32),  # 8 prompts: 8 sequences of 17 tokens, 2 blocks each
        ([9], 8, 3, 3 * 32),  # n = 3: a sequence per choice
        ([9, 30], 7, 2, 2 * 16 + 2 * 48),  # 16 tokens: 1 block; 37: 3 blocks
        ([16], 16, 1, 32),  # whole blocks exactly
    ],
)
def test_claim_is_whole_blocks_per_sequence(
    prompts: list[int], max_tokens: int, n: int, claim: int
) -> None:
    sequences = kv_sequences(prompts, OutputPlan(max_tokens, None), n)
    assert kv_claim(RouteRequest("m", sequences=sequences), B) == claim


def test_no_room_anywhere_is_429_with_retry_after_and_room_elsewhere_routes() -> None:
    full = view(url="a", kv_capacity_tokens=160, inflight=1, inflight_tokens=128)
    roomy = view(url="b", kv_capacity_tokens=1600, inflight=1, inflight_tokens=128, kv_usage=0.9)
    req = RouteRequest("m", sequences=(100,))
    assert pick_backend(req, [full, roomy]) == "b"  # the fuller scrape loses to real room
    with pytest.raises(Overloaded) as e:
        pick_backend(req, [full], retry_after_s=2.0)
    assert e.value.status == 429 and e.value.headers() == {"Retry-After": "2"}
    assert "128 of 160 tokens claimed" in e.value.message


# vLLM 0.26.0 and 0.32.0 both give cache_config_info with these labels (0.32 adds more);
# before the engine sized its cache num_gpu_blocks reads "None"
V026 = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
    'gpu_memory_utilization="0.9",num_gpu_blocks="512",num_gpu_blocks_override="512"} 1.0\n'
)
# what vLLM 0.26.0 gave on the H200 (issue 39's check), trimmed: kv_cache_size_tokens too
V026_H200 = (
    'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="3952288",'
    'num_gpu_blocks="247018",num_gpu_blocks_override="None"} 1.0\n'
)
V032 = (
    'vllm:cache_config_info{block_size="16",engine="0",kv_cache_memory_bytes="None",'
    'num_gpu_blocks="132493",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0\n'
)


@pytest.mark.parametrize(
    ("text", "capacity"),
    [
        (V026, 512 * 16),
        (V032, 132493 * 16),
        (V026_H200, 3952288),
        ('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n', None),
        ("", None),
        # two engines (data parallel): the smaller cache decides
        (V026 + V026.replace('engine="0"', 'engine="1"').replace('="512"', '="300"'), 300 * 16),
    ],
)
def test_capacity_from_cache_config_info(text: str, capacity: int | None) -> None:
    head = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    head += "# TYPE vllm:cache_config_info gauge\n"
    assert parse_metrics(head + text if text else "").kv_capacity_tokens == capacity


MAX_TOKENS = 200


def test_over_capacity_gets_429_and_every_claim_is_given_back(make_gateway, fake) -> None:
    url, state = fake
    state.tokens = [f" t{i}" for i in range(MAX_TOKENS)]
    # a stream lasts 100 min: only the test ends the held ones (at 0.1 s a token, 20 s, a
    # loaded machine could outlast, and a held claim went back by itself)
    state.pace_s = 30.0
    with make_gateway([url], scrape_interval_s=0.1, kv_admit_wait_s=0) as gw:
        # one stream's claim as the gateway counts it (prompt + max_tokens; a streamed
        # prompt may be counted as an upper bound while it is on its way)
        body = chat(stream=True, max_tokens=MAX_TOKENS)
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body) as r:
            chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)
            one_claim = _claimed(gw, url)
        wait_for(lambda: _claimed(gw, url) == 0)
        assert one_claim >= MAX_TOKENS and one_claim % B == 0  # whole blocks
        claim = one_claim
        # room for exactly two: 2 claims + the null block <= capacity < 3 claims + null
        blocks = int(2 * claim) // B + 1 + 1
        assert 2 * claim <= (blocks - 1) * B < 3 * claim
        state.num_gpu_blocks, state.block_size = blocks, B
        wait_for(lambda: _capacity_seen(gw, url))

        async def burst() -> list[int]:
            release = asyncio.Event()
            async with httpx.AsyncClient(timeout=30) as client:

                async def one() -> int:
                    body = chat(stream=True, max_tokens=MAX_TOKENS)
                    async with client.stream("POST", f"{gw}/v1/chat/completions", json=body) as r:
                        if r.status_code == 200:
                            chunks = r.aiter_bytes()  # kept: a dropped one closes the stream
                            await anext(chunks)  # streaming: its claim is held
                            await release.wait()  # then the client hangs up
                        else:
                            await r.aread()
                            assert r.headers["retry-after"] == "1"
                            assert r.json()["error"]["code"] == "overloaded"
                        return r.status_code

                tasks = [asyncio.create_task(one()) for _ in range(6)]
                deadline = time.monotonic() + 30
                while sum(t.done() for t in tasks) < 4:  # the four refused end at once
                    assert time.monotonic() < deadline, "four were not refused"
                    await asyncio.sleep(0.01)
                held = metric(gw, "lorastack_gateway_backend_kv_claimed_tokens", backend=url)
                assert held == 2 * one_claim
                release.set()
                return sorted(await asyncio.gather(*tasks))

        assert asyncio.run(burst()) == [200, 200, 429, 429, 429, 429]
        assert len(state.calls()) == 3  # the first and the two admitted: nothing else reached it
        wait_for(lambda: state.cancelled == 3)
        wait_for(lambda: _claimed(gw, url) == 0)  # client disconnect gave both back
        assert state.preemptions == 0  # the fake counts one when its blocks run out

        # completion, an upstream error before the first byte, one mid-stream: each gives back
        state.pace_s = 0.0
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS))
        assert r.status_code == 200 and _claimed(gw, url) == 0
        state.fail_status, state.fail_count = 500, 1
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS))
        assert r.status_code == 500 and _claimed(gw, url) == 0
        state.die_after_tokens = 3
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True, max_tokens=MAX_TOKENS))
        assert r.status_code == 200 and "upstream_broken" in r.text
        assert _claimed(gw, url) == 0
        assert metric(gw, "lorastack_gateway_backend_inflight", backend=url) == 0


def test_a_request_waits_for_room_then_runs_instead_of_429(make_gateway, fake) -> None:
    """Within `kv_admit_wait_s` a request that does not fit waits for a claim to be given
    back (vLLM would queue it too, but could preempt for it): the test ends the holder."""
    url, state = fake
    state.tokens = [f" t{i}" for i in range(MAX_TOKENS)]
    state.pace_s = 30.0  # the holder lasts until the test hangs up (at 0.1 s: 20 s, racy)
    state.num_gpu_blocks, state.block_size = 30, B  # 464 usable tokens: one request at a time
    with make_gateway([url], scrape_interval_s=0.1, kv_admit_wait_s=30) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        body = chat(stream=True, max_tokens=MAX_TOKENS)
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body) as holder:
            chunks = holder.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)

            async def second() -> httpx.Response:
                async with httpx.AsyncClient(timeout=60) as c:
                    return await c.post(f"{gw}/v1/chat/completions", json=body | {"stream": False})

            async def scenario() -> httpx.Response:
                task = asyncio.create_task(second())
                deadline = time.monotonic() + 30
                while metric(gw, "lorastack_gateway_kv_admission_waiting") != 1:
                    assert time.monotonic() < deadline, "the second request never waited"
                    await asyncio.sleep(0.02)
                assert len(state.calls()) == 1  # it waits in the gateway, not in vLLM
                state.pace_s = 0.0  # the second answers at once once admitted
                await asyncio.to_thread(holder.close)  # the holder hangs up: room again
                return await task

            r = asyncio.run(scenario())
        assert r.status_code == 200 and len(state.calls()) == 2
        assert state.preemptions == 0
        wait_for(lambda: _claimed(gw, url) == 0)


def _claimed(gw: str, url: str) -> float:
    return metric(gw, "lorastack_gateway_backend_kv_claimed_tokens", backend=url)


def _capacity_seen(gw: str, url: str) -> bool:
    """The gateway's scrape has read the fake's new capacity."""
    seen = metric(gw, "lorastack_gateway_backend_kv_capacity_tokens", backend=url)
    return seen == seen and seen > 0  # NaN until reported


# Completions with token ids: prompts counted exactly (IDS_9 is 9 tokens), so each
# sequence's claim is known: ceil((9 + max_tokens) / B) blocks.
IDS_9 = list(range(100, 109))


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "smollm2", "prompt": IDS_9, **extra}


def _post_and_hang(gw: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a whole request on a raw connection and return it unread: closing it is the
    client hanging up."""
    parts = urlsplit(gw)
    sock = socket.create_connection((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _waiting(gw: str) -> float:
    return metric(gw, "lorastack_gateway_kv_admission_waiting")


@pytest.mark.parametrize(
    ("prompt", "n", "claim"),
    [([IDS_9] * 8, 1, 8 * 2 * B), (IDS_9, 3, 3 * 2 * B)],  # 17 tokens a sequence: 2 blocks
)
def test_batched_prompts_and_n_claim_blocks_per_sequence(
    make_gateway, fake, prompt: list[Any], n: int, claim: int
) -> None:
    url, state = fake
    state.pace_s = 30.0  # held until the test hangs up
    state.num_gpu_blocks, state.block_size = 1000, B
    with make_gateway([url], scrape_interval_s=0.1) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        body = completion(prompt=prompt, n=n, max_tokens=8, stream=True)
        with httpx.stream("POST", f"{gw}/v1/completions", json=body) as r:
            chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)
            assert _claimed(gw, url) == claim  # what vLLM allocates for them
        wait_for(lambda: _claimed(gw, url) == 0)


def test_a_unary_request_whose_client_hangs_up_gives_its_claim_back(make_gateway, fake) -> None:
    url, state = fake
    state.tokens = [f" t{i}" for i in range(MAX_TOKENS)]
    state.pace_s = 30.0  # the answer would take 100 min
    with make_gateway([url], scrape_interval_s=0.1) as gw:
        sock = _post_and_hang(gw, "/v1/completions", completion(max_tokens=MAX_TOKENS))
        wait_for(lambda: _claimed(gw, url) > 0 and len(state.calls("/completions")) == 1)
        sock.close()
        wait_for(lambda: _claimed(gw, url) == 0)
        assert metric(gw, "lorastack_gateway_backend_inflight", backend=url) == 0
        wait_for(lambda: state.cancelled == 1)  # the upstream call was closed: vLLM aborts
        assert state.completed == 0


def _holding(gw: str, body: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """A stream that holds its claim (its first chunk read) until the block ends."""

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        with httpx.stream("POST", f"{gw}/v1/completions", json=body | {"stream": True}) as r:
            chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)
            yield

    return hold()


def test_a_waiting_request_whose_client_leaves_is_never_sent(make_gateway, fake) -> None:
    url, state = fake
    state.tokens = [f" t{i}" for i in range(MAX_TOKENS)]
    state.pace_s = 30.0
    # one claim is 9 + 200 tokens = 14 blocks; 19 usable: room for one at a time
    state.num_gpu_blocks, state.block_size = 20, B
    body = completion(max_tokens=MAX_TOKENS)
    with make_gateway([url], scrape_interval_s=0.1, kv_admit_wait_s=60) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        with _holding(gw, body):
            sock = _post_and_hang(gw, "/v1/completions", body)
            wait_for(lambda: _waiting(gw) == 1)
            sock.close()
            wait_for(lambda: _waiting(gw) == 0)  # out of the line while the holder runs
            assert len(state.calls("/completions")) == 1
            state.pace_s = 0.0
        wait_for(lambda: _claimed(gw, url) == 0)
        r = httpx.post(f"{gw}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        # the holder and the last: the one that left was never sent
        assert len(state.calls("/completions")) == 2
        assert _claimed(gw, url) == 0


def test_a_large_request_is_admitted_before_smaller_ones_that_came_later(
    make_gateway, fake
) -> None:
    url, state = fake
    state.tokens = [f" t{i}" for i in range(100)]
    state.pace_s = 30.0
    state.num_gpu_blocks, state.block_size = 7, B  # 6 usable blocks
    small = completion(max_tokens=23)  # 32 tokens: 2 blocks, a third of the room
    large = completion(max_tokens=87)  # 96 tokens: 6 blocks, all of it
    with make_gateway([url], scrape_interval_s=0.1, kv_admit_wait_s=60) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        with ThreadPoolExecutor(5) as pool, _holding(gw, small):
            answers = [pool.submit(httpx.post, f"{gw}/v1/completions", json=large, timeout=60)]
            wait_for(lambda: _waiting(gw) == 1)
            for i in range(4):  # each would fit beside the holder, but the large came first
                answers.append(
                    pool.submit(httpx.post, f"{gw}/v1/completions", json=small, timeout=60)
                )
                wait_for(lambda i=i: _waiting(gw) == 2 + i)
            assert len(state.calls("/completions")) == 1
            state.pace_s = 0.0  # the rest answer at once once admitted
        assert [a.result().status_code for a in answers] == [200] * 5
        sent = [call["max_tokens"] for call in state.calls("/completions")]
        assert sent == [23, 87, 23, 23, 23, 23]  # the holder, then in order of arrival
        wait_for(lambda: _claimed(gw, url) == 0)


def test_a_request_for_an_idle_backend_never_waits_behind_another_backends_line(
    make_gateway, fake, second_fake, embedded_model
) -> None:
    """Issue 58, finding 1: the line for KV room is per backend. A request for `other`,
    served by an idle backend, is answered while a request for `smollm2` still waits for
    room on its own, full backend (before: it waited behind it, 3.91 s)."""
    url, state = fake
    other_url, other = second_fake
    other.models = [{"id": "other", "max_model_len": 2048}]
    state.tokens = [f" t{i}" for i in range(MAX_TOKENS)]
    state.pace_s = 30.0  # the holder lasts until the test hangs up
    state.num_gpu_blocks, state.block_size = 20, B  # 19 usable blocks: one claim of 14
    body = completion(max_tokens=MAX_TOKENS)
    tokenizers = {"smollm2": str(embedded_model), "other": str(embedded_model)}
    # 60 s: far longer than the steps below take on a loaded machine, so the waiter is
    # still in line when `other` is answered (it is the test that ends the holder)
    with make_gateway([url, other_url], kv_admit_wait_s=60, tokenizers=tokenizers) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        wait_for(lambda: httpx.get(f"{gw}/v1/models/other").status_code == 200)
        with ThreadPoolExecutor(1) as pool, _holding(gw, body):
            waiter = pool.submit(httpx.post, f"{gw}/v1/completions", json=body, timeout=90)
            wait_for(lambda: _waiting(gw) == 1)
            r = httpx.post(f"{gw}/v1/completions", json=body | {"model": "other"}, timeout=90)
            assert r.status_code == 200, r.text
            assert _waiting(gw) == 1 and not waiter.done()  # still in its own line
            assert len(other.calls("/completions")) == 1
            state.pace_s = 0.0
        assert waiter.result().status_code == 200


A3200 = view(url="a", kv_capacity_tokens=3200)  # 200 blocks: 1,600 tokens at a share of 0.5
B6400 = view(url="b", kv_capacity_tokens=6400)


@pytest.mark.parametrize(
    ("sequences", "views", "share", "outcome"),
    [
        ((1009,) * 8, [A3200], 0.5, "too large"),  # n=8 x (9 + 1000): 8 x 1,024 tokens
        ((200,) * 8, [A3200, B6400], 0.5, "b"),  # 8 x 208 = 1,664: over a's 1,600, not b's
        ((190,) * 8, [A3200], 0.5, "a"),  # 8 x 192 = 1,536: within a's share
        ((3000,), [A3200], 0.5, "a"),  # one sequence: held to max_model_len, not to the share
        # within the share (8,192 of 8,208), but 32 tokens are claimed already: it waits
        ((1009,) * 8, [view(kv_capacity_tokens=8208, inflight=1, inflight_tokens=32)], 1, "wait"),
    ],
)
def test_a_request_over_its_share_of_every_backend_is_refused_with_the_numbers(
    sequences: tuple[int, ...], views: list[BackendView], share: float, outcome: str
) -> None:
    req = RouteRequest("m", sequences=sequences)
    thresholds = Thresholds(kv_request_share=share)
    if outcome == "too large":
        with pytest.raises(KvClaimTooLarge) as e:
            pick_backend(req, views, thresholds=thresholds)
        assert e.value.status == 400 and e.value.param == "n"
        text = e.value.body()["error"]["message"]
        assert "8192 tokens" in text and "at most 1600 tokens" in text, text
        assert "3200-token KV cache" in text and "n x (prompt + max_tokens) <= 1600" in text
    elif outcome == "wait":
        with pytest.raises(NoKvRoom):
            pick_backend(req, views, thresholds=thresholds)
    else:
        assert pick_backend(req, views, thresholds=thresholds) == outcome


def test_n_times_max_tokens_over_the_share_is_a_400_and_small_requests_keep_their_room(
    make_gateway, fake
) -> None:
    """Issue 58, finding 2: `n=8, max_tokens=1000` on a 3,200-token backend claimed 10,624
    tokens and was admitted because the backend was empty; every small request after it
    got 429 for as long as it ran. Now it is a 400 that names the numbers, and a request
    of two sequences within the share runs beside a small one."""
    url, state = fake
    state.pace_s = 30.0  # held until the test hangs up
    state.num_gpu_blocks, state.block_size = 200, B
    with make_gateway([url], kv_admit_wait_s=0) as gw:
        wait_for(lambda: _capacity_seen(gw, url))
        r = httpx.post(f"{gw}/v1/completions", json=completion(n=8, max_tokens=1000))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "kv_claim_too_large" and error["param"] == "n"
        assert "8 sequences" in error["message"] and "at most 1600 tokens" in error["message"]
        assert state.calls("/completions") == []  # vLLM never saw it
        # 2 x 512 of 1,600: within its share; a small one still fits beside it
        with (
            _holding(gw, completion(n=2, max_tokens=500)),
            _holding(gw, completion(max_tokens=500)),
        ):
            assert _claimed(gw, url) == 3 * 512
        wait_for(lambda: _claimed(gw, url) == 0)


def test_one_process_lines_wake_only_the_first_waiter_of_the_backend_given_room() -> None:
    line = InflightCounter()
    a, b = "http://a", "http://b"

    async def scenario() -> None:
        first = line.join({a})
        second = line.join({a, b})
        third = line.join({b})
        assert line.blocked(None) == {a, b} and line.blocked(second) == {a}
        line.add(b, -1)  # room on b: second is first in b's line
        assert second.is_set() and not first.is_set() and not third.is_set()
        second.clear()
        line.add(a, -1)
        assert first.is_set() and not second.is_set()
        line.leave(first)  # second is first in a's line now
        assert second.is_set() and line.blocked(third) == {a, b}
        line.leave(second)
        assert third.is_set() and line.blocked(third) == set()
        line.leave(third)
        assert line.waiting == 0 and line.blocked(None) == set()

    asyncio.run(scenario())
