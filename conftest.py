"""Fixtures shared by every test suite: isolated settings, a real S3 server on loopback
(moto), and the embedded base model converted once per machine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastack_testing.net import free_port

os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent
TEST_HOME = REPO / ".cache" / "test-home"  # survives runs: the model conversion is slow


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh LORASTACK_HOME for commands that build their own settings."""
    h = tmp_path / "home"
    monkeypatch.setenv("LORASTACK_HOME", str(h))
    monkeypatch.delenv("LORASTACK_STORE_URL", raising=False)
    return h


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The SmolLM2-135M-Instruct HF folder, converted from the GGUF once per machine."""
    from lorastack.base_model import convert_gguf, find_default_gguf
    from lorastack.manifest import sha256_file

    gguf = find_default_gguf()
    out = TEST_HOME / "models" / f"smollm2-{sha256_file(gguf)[:12]}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out
