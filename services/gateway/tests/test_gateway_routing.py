"""Routing scorers and the pick, table-driven over plain data (no network)."""

from __future__ import annotations

import pytest

from gateway.claims import InflightCounter
from gateway.errors import Overloaded, UpstreamUnavailable
from gateway.routing import (
    BackendView,
    RouteRequest,
    Thresholds,
    Weights,
    is_full,
    pick_backend,
    score_capacity,
    score_kv_usage,
    score_lora_affinity,
    score_prefix,
    score_session,
    score_static,
)

M = frozenset({"base", "sql"})


def b(url: str, **kw: object) -> BackendView:
    return BackendView(url=url, models=kw.pop("models", M), **kw)  # type: ignore[arg-type]


BASE = RouteRequest("base")
SQL = RouteRequest("sql", adapter=True)


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([b("a", kv_usage=0.0), b("b", kv_usage=1.0)], {"a": 1.0, "b": 0.0}),
        ([b("a", kv_usage=0.25)], {"a": 0.75}),
        ([b("a")], {"a": 0.5}),  # not scraped yet: neutral
        ([b("a", kv_usage=1.7)], {"a": 0.0}),  # clipped
    ],
)
def test_score_kv_usage(views: list[BackendView], expected: dict[str, float]) -> None:
    assert score_kv_usage(BASE, views) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        # the case: a 1-slot replica busy, an 8-slot one running 4: the free slot wins
        (
            [b("one", max_num_seqs=1, running=1, waiting=3), b("eight", max_num_seqs=8, running=4)],
            {"one": 0.5 / 4, "eight": 0.75},
        ),
        # running requests alone do not make a replica look like a queued one
        (
            [b("a", max_num_seqs=8, running=7), b("b", max_num_seqs=8, waiting=1)],
            {"a": 0.5 + 0.5 / 8, "b": 0.5 / (1 + 1 / 8)},
        ),
        # sent since the scrape fill the free slots, then count as waiting
        ([b("a", max_num_seqs=2, running=1, sent_since_scrape=1)], {"a": 0.5}),
        ([b("a", max_num_seqs=2, running=2, sent_since_scrape=2)], {"a": 0.5 / 2}),
        # requests on their way, not yet counted by vLLM at the scrape, hold their slots
        ([b("a", max_num_seqs=2, inflight=2)], {"a": 0.5 / 1.0}),
        ([b("a", max_num_seqs=4, inflight=3, waiting=1)], {"a": 0.5 / (1 + 1 / 4)}),
        ([b("a", max_num_seqs=4, inflight=1)], {"a": 0.5 + 0.5 * 3 / 4}),
        ([b("a", max_num_seqs=4)], {"a": 1.0}),  # idle
        ([b("a", waiting=1), b("b")], {"a": 0.25, "b": 0.5}),  # max_num_seqs unknown
        ([b("a", max_num_seqs=4, running=1, waiting=2)], {"a": 0.5 / 1.5}),  # free but queued
        # full: what waits ahead per running slot
        (
            [
                b("one", max_num_seqs=1, running=1, waiting=1),
                b("eight", max_num_seqs=8, running=8, waiting=3),
            ],
            {"one": 0.25, "eight": 0.5 / (1 + 3 / 8)},
        ),
    ],
)
def test_score_capacity(views: list[BackendView], expected: dict[str, float]) -> None:
    scores = score_capacity(BASE, views)
    assert scores == pytest.approx(expected)
    assert all(0.0 <= s <= 1.0 for s in scores.values())


@pytest.mark.parametrize(
    ("req", "views", "expected"),
    [
        (BASE, [b("a"), b("b")], {"a": 1.0, "b": 1.0}),  # a base model: no preference
        (
            SQL,
            [b("a", loaded_adapters=frozenset({"sql"}), max_lora=1), b("b", max_lora=1)],
            {"a": 1.0, "b": 0.5},
        ),
        (SQL, [b("a", loaded_adapters=frozenset({"other"}), max_lora=1)], {"a": 0.0}),  # full
        (
            SQL,
            [b("a", loaded_adapters=frozenset({"other"}), max_lora=2)],
            {"a": 0.5},
        ),  # a slot free
    ],
)
def test_score_lora_affinity(
    req: RouteRequest, views: list[BackendView], expected: dict[str, float]
) -> None:
    assert score_lora_affinity(req, views) == expected


@pytest.mark.parametrize(
    ("req", "views", "avoid", "expected"),
    [
        (BASE, [b("a", kv_usage=0.9), b("b", kv_usage=0.1)], (), "b"),
        (BASE, [b("a", kv_usage=0.1), b("b", kv_usage=0.1, waiting=4)], (), "a"),
        (BASE, [b("a", kv_usage=0.3), b("b", kv_usage=0.3)], (), "a"),  # tie: by url
        (BASE, [b("a", kv_usage=0.3, inflight=1), b("b", kv_usage=0.3)], (), "b"),
        (
            SQL,
            [
                b("a", kv_usage=0.6, loaded_adapters=frozenset({"sql"}), max_lora=1),
                b("b", kv_usage=0.2, loaded_adapters=frozenset({"x"}), max_lora=1),
            ],
            (),
            "a",
        ),
        (BASE, [b("a", kv_usage=0.1), b("b", kv_usage=0.5)], ("a",), "b"),  # retry elsewhere
        (BASE, [b("a", kv_usage=0.1)], ("a",), "a"),  # nothing else left
        (BASE, [b("a", kv_usage=0.1, healthy=False), b("b", kv_usage=0.9)], (), "b"),
        (SQL, [b("a", models=frozenset({"base"})), b("b", kv_usage=0.9)], (), "b"),
        (BASE, [b("a", kv_usage=0.99, waiting=9), b("b", kv_usage=0.99, waiting=1)], (), "b"),
    ],
)
def test_pick_backend(
    req: RouteRequest, views: list[BackendView], avoid: tuple[str, ...], expected: str
) -> None:
    assert pick_backend(req, views, avoid=avoid) == expected


def test_all_saturated_is_overloaded_with_retry_after() -> None:
    views = [b("a", kv_usage=0.97, waiting=8), b("b", kv_usage=1.0, waiting=30)]
    with pytest.raises(Overloaded) as e:
        pick_backend(BASE, views, thresholds=Thresholds(0.95, 8), retry_after_s=2.5)
    assert e.value.headers() == {"Retry-After": "3"} and e.value.status == 429


def test_no_backend_serves_the_model() -> None:
    with pytest.raises(UpstreamUnavailable):
        pick_backend(BASE, [b("a", healthy=False)])


@pytest.mark.parametrize(
    ("view", "full"),
    [
        (b("a"), False),  # nothing known: not full
        (b("a", waiting=1), True),
        (b("a", max_num_seqs=2, running=1), False),
        (b("a", max_num_seqs=2, running=1, sent_since_scrape=1), True),
        (b("a", max_num_seqs=1, running=1), True),
    ],
)
def test_is_full(view: BackendView, full: bool) -> None:
    assert is_full(view) is full


def test_a_free_slot_wins_over_a_lower_kv_usage() -> None:
    # the 1-slot replica has the emptier KV cache, but a request there would wait
    views = [
        b("one", max_num_seqs=1, running=1, kv_usage=0.05),
        b("eight", max_num_seqs=8, running=7, kv_usage=0.6),
    ]
    assert pick_backend(BASE, views) == "eight"
    # every replica full: the scores pick among them (shortest queue)
    views = [b("one", max_num_seqs=1, running=1, waiting=3), b("eight", max_num_seqs=8, running=8)]
    assert pick_backend(BASE, views) == "eight"


def _simulate(arrival_gap_s: float, duration_s: float, scrape_s: float) -> dict[str, object]:
    """16 requests to two replicas (max_num_seqs 1 and 8) through `pick_backend`, the
    gateway's view built as `Backends.views` builds it: the last scrape's running and
    waiting, requests sent since that scrape and still open. Returns where each went and
    every moment a request was sent to a full replica while the other had had a free slot
    for longer than one scrape interval."""
    slots = {"one": 1, "eight": 8}
    running: dict[str, list[float]] = {u: [] for u in slots}  # end times
    waiting: dict[str, list[float]] = {u: [] for u in slots}  # durations
    scraped = {u: (0, 0) for u in slots}  # (running, waiting)
    counter = InflightCounter()
    sent_at_scrape = {u: 0 for u in slots}
    free_since = {u: 0.0 for u in slots}
    placed: dict[str, int] = {u: 0 for u in slots}
    late: list[tuple[float, str]] = []

    def advance(t: float) -> None:
        for u in slots:
            for end in sorted(e for e in running[u] if e <= t):
                running[u].remove(end)
                counter.add(u, -1)
                if waiting[u]:
                    running[u].append(end + waiting[u].pop(0))
                elif len(running[u]) == slots[u] - 1:
                    free_since[u] = end

    events = sorted(
        [(i * arrival_gap_s, "request") for i in range(16)]
        + [(k * scrape_s, "scrape") for k in range(int(60 / scrape_s))]
    )
    for t, what in events:
        advance(t)
        if what == "scrape":
            for u in slots:
                scraped[u] = (len(running[u]), len(waiting[u]))
                sent_at_scrape[u] = counter.sent.get(u, 0)
            continue
        views = [
            b(
                u,
                max_num_seqs=slots[u],
                running=scraped[u][0],
                waiting=scraped[u][1],
                inflight=counter.counts.get(u, 0),
                sent_since_scrape=min(
                    counter.counts.get(u, 0), counter.sent.get(u, 0) - sent_at_scrape[u]
                ),
            )
            for u in slots
        ]
        u = pick_backend(BASE, views)
        placed[u] += 1
        counter.add(u, 1)
        other = next(o for o in slots if o != u)
        if len(running[u]) >= slots[u]:
            if len(running[other]) < slots[other] and t - free_since[other] > scrape_s:
                late.append((t, u))
            waiting[u].append(duration_s)
        else:
            running[u].append(t + duration_s)
            if len(running[u]) == slots[u]:
                free_since[u] = float("inf")
    return {"placed": placed, "late": late}


@pytest.mark.parametrize("gap_s", [0.3, 0.0])  # the 300 ms apart, and a burst
def test_no_request_waits_beside_a_free_slot(gap_s: float) -> None:
    """The issue's two replicas, one running 1 request at a time and one running 8: the
    old queue scorer split 16 requests 8/8 and queued 3-7 on the small one."""
    result = _simulate(gap_s, duration_s=3.0, scrape_s=2.0)
    assert result["late"] == []
    placed = result["placed"]
    assert isinstance(placed, dict) and placed["eight"] >= 13, placed


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (BASE, {"a": 1.0, "b": 1.0}),  # no full block: neutral
        (RouteRequest("base", prefix_blocks=4), {"a": 0.0, "b": 0.0}),  # nobody served it
        (
            RouteRequest("base", prefix_blocks=4, prefix_hits={"a": 1, "b": 3}),
            {"a": 0.25, "b": 0.75},
        ),
        (
            RouteRequest("base", prefix_blocks=2, prefix_hits={"b": 2, "gone": 2}),
            {"a": 0.0, "b": 1.0},
        ),
    ],
)
def test_score_prefix(req: RouteRequest, expected: dict[str, float]) -> None:
    assert score_prefix(req, [b("a"), b("b")]) == expected


@pytest.mark.parametrize(
    ("session_backend", "expected"),
    [
        (None, {"a": 1.0, "b": 1.0}),
        ("b", {"a": 0.0, "b": 1.0}),
        ("gone", {"a": 1.0, "b": 1.0}),  # its replica is not a candidate: no preference
    ],
)
def test_score_session(session_backend: str | None, expected: dict[str, float]) -> None:
    req = RouteRequest("base", session_backend=session_backend)
    assert score_session(req, [b("a"), b("b")]) == expected


@pytest.mark.parametrize(
    ("req", "views", "expected"),
    [
        # the session's replica wins over an emptier one ...
        (
            RouteRequest("base", session_backend="b"),
            [b("a", kv_usage=0.0, max_num_seqs=8), b("b", kv_usage=0.7, max_num_seqs=8, running=6)],
            "b",
        ),
        # ... but not when a request there would wait and the other has a free slot
        (
            RouteRequest("base", session_backend="b"),
            [b("a", max_num_seqs=8), b("b", max_num_seqs=8, running=8)],
            "a",
        ),
        # ... nor when it is down or saturated
        (RouteRequest("base", session_backend="b"), [b("a"), b("b", healthy=False)], "a"),
        (
            RouteRequest("base", session_backend="b"),
            [b("a", kv_usage=0.5), b("b", kv_usage=0.99, waiting=9)],
            "a",
        ),
        # the longest prefix match wins over an emptier KV cache
        (
            RouteRequest("base", prefix_blocks=3, prefix_hits={"a": 1, "b": 3}),
            [b("a", kv_usage=0.0), b("b", kv_usage=0.6)],
            "b",
        ),
        # session and prefix disagree: the session wins (its own last turn is longest)
        (
            RouteRequest("base", session_backend="a", prefix_blocks=3, prefix_hits={"b": 3}),
            [b("a", kv_usage=0.3), b("b", kv_usage=0.3)],
            "a",
        ),
        # an adapter: the one with it loaded wins over a shared-system-prompt hit
        (
            RouteRequest("sql", adapter=True, prefix_blocks=4, prefix_hits={"b": 1}),
            [
                b("a", loaded_adapters=frozenset({"sql"}), max_lora=1),
                b("b", loaded_adapters=frozenset({"x"}), max_lora=1),
            ],
            "a",
        ),
    ],
)
def test_pick_with_affinity(req: RouteRequest, views: list[BackendView], expected: str) -> None:
    assert pick_backend(req, views) == expected


def test_affinity_off_by_weight() -> None:
    req = RouteRequest("base", session_backend="b", prefix_blocks=2, prefix_hits={"b": 2})
    views = [b("a", kv_usage=0.1), b("b", kv_usage=0.5)]
    assert pick_backend(req, views) == "b"
    assert pick_backend(req, views, weights=Weights(prefix=0.0, session=0.0)) == "a"


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([b("a"), b("b")], {"a": 1.0, "b": 1.0}),  # unweighted: neutral
        ([b("a", weight=3.0), b("b")], {"a": 1.0, "b": 1 / 3}),
        ([b("a", weight=0.5), b("b", weight=2.0)], {"a": 0.25, "b": 1.0}),
        ([b("a", weight=2.0)], {"a": 1.0}),
    ],
)
def test_score_static(views: list[BackendView], expected: dict[str, float]) -> None:
    assert score_static(BASE, views) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("views", "weights", "expected"),
    [
        ([b("a"), b("b", weight=2.0)], Weights(), "b"),  # else a tie, which "a" wins
        ([b("a"), b("b", weight=2.0)], Weights(static=0.0), "a"),  # off
        # a far emptier KV cache outweighs a double weight at the default weights
        ([b("a", kv_usage=0.0), b("b", kv_usage=0.9, weight=2.0)], Weights(), "a"),
        ([b("a", kv_usage=0.0), b("b", kv_usage=0.9, weight=2.0)], Weights(static=4.0), "b"),
    ],
)
def test_pick_by_static_weight(views: list[BackendView], weights: Weights, expected: str) -> None:
    assert pick_backend(BASE, views, weights=weights) == expected
