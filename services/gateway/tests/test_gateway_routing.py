"""Routing scorers and the pick, table-driven over plain data (no network)."""

from __future__ import annotations

import pytest

from gateway.errors import Overloaded, UpstreamUnavailable
from gateway.routing import (
    BackendView,
    RouteRequest,
    Thresholds,
    pick_backend,
    score_capacity,
    score_kv_usage,
    score_lora_affinity,
    score_queue,
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
        ([b("a"), b("b", waiting=1)], {"a": 1.0, "b": 0.5}),
        ([b("a", waiting=3), b("b", inflight=2)], {"a": 0.25, "b": 0.5}),
    ],
)
def test_score_queue(views: list[BackendView], expected: dict[str, float]) -> None:
    assert score_queue(BASE, views) == pytest.approx(expected)


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
            {"a": 0.5 + 0.5 / 8, "b": 0.25},
        ),
        # sent since the scrape fill the free slots, then count as waiting
        ([b("a", max_num_seqs=2, running=1, sent_since_scrape=1)], {"a": 0.5}),
        ([b("a", max_num_seqs=2, running=2, sent_since_scrape=2)], {"a": 0.5 / 3}),
        ([b("a", max_num_seqs=4)], {"a": 1.0}),  # idle
        ([b("a", waiting=1), b("b")], {"a": 0.25, "b": 0.5}),  # max_num_seqs unknown
        ([b("a", max_num_seqs=4, running=1, waiting=2)], {"a": 0.5 / 3}),  # free but queued
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
