"""Gateway fixtures: the fake vLLM (lorastack_testing) on loopback, a real gateway in front."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules share helpers (test_gateway_proxy)

from gateway.main import create_app
from gateway.settings import GatewaySettings
from lorastack_testing.fake_vllm import FakeState, serve_fake
from lorastack_testing.net import free_port, serve_in_thread, wait_for


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with serve_fake(state) as url:
        yield url, state


@pytest.fixture
def second_fake() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with serve_fake(state) as url:
        yield url, state


GatewayFactory = Callable[..., contextlib.AbstractContextManager[str]]


@pytest.fixture
def make_gateway(embedded_model: Path, tmp_path: Path) -> GatewayFactory:
    """`with make_gateway([backend urls], **settings) as url:` a running gateway."""

    @contextlib.contextmanager
    def start(backends: list[str], **overrides: Any) -> Iterator[str]:
        values: dict[str, Any] = {
            "home": tmp_path / "home",
            "backends": backends,
            "tokenizers": {"smollm2": str(embedded_model)},
            "scrape_interval_s": 0.1,
            "retry_backoff_s": 0.01,
        }
        values.update(overrides)
        app = create_app(GatewaySettings(**values))
        with serve_in_thread(app, free_port()) as url:
            wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, "gateway ready", 60)
            yield url

    return start
