"""Fixtures shared by every test suite: isolated settings, a real S3 server on loopback
(moto), and the embedded base model converted once per machine; and how the suite is spread
over pytest-xdist's processes (scripts/test.sh runs two)."""

from __future__ import annotations

import fcntl
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastack_testing.net import free_port

os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent
TEST_HOME = REPO / ".cache" / "test-home"  # survives runs: the model conversion is slow


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh: --dist loadfile, a test file one unit of work, so
    its module and session fixtures are made once, in one process), the files with the most
    slow tests go first, so the longest unit never starts last while the other process idles
    (xdist hands the files out in this order with --no-loadscope-reorder)."""
    if not hasattr(config, "workerinput"):  # only xdist's worker processes collect for it
        return
    slow = Counter(str(item.path) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[str(item.path)])  # stable: a file's order is kept


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh LORASTACK_HOME for commands that build their own settings."""
    h = tmp_path / "home"
    monkeypatch.setenv("LORASTACK_HOME", str(h))
    monkeypatch.delenv("LORASTACK_STORE_URL", raising=False)
    return h


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from lorastack_testing.s3 import S3Server

    server = S3Server(free_port())
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The SmolLM2-135M-Instruct HF folder, converted from the GGUF once per machine."""
    from lorastack.base_model import convert_gguf, find_default_gguf
    from lorastack.manifest import sha256_file

    gguf = find_default_gguf()
    out = TEST_HOME / "models" / f"smollm2-{sha256_file(gguf)[:12]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # one process converts, another (pytest-xdist's) waits for it rather than racing
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            convert_gguf(gguf, out)
    return out
