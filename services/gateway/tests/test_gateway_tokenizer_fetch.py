"""The tokenizer of a store artifact: only its tokenizer files are fetched (never the
weights beside them), a failed load is retried after a backoff, and /ready says 503 while
a served model has no tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from test_gateway_proxy import chat

from gateway.errors import TokenizerUnavailable
from gateway.main import create_app
from gateway.settings import GatewaySettings
from gateway.tokens import RETRY_FIRST_S, RETRY_MAX_S, TokenizerCache, retry_delay
from lorastack.store import open_store
from lorastack_testing.net import free_port, serve_in_thread, wait_for

WEIGHTS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _base_folder(embedded_model: Path, folder: Path) -> Path:
    """The SmolLM2 tokenizer beside two weight shards (small stand-ins: a real base's
    would be GBs; what counts is whether they are fetched at all)."""
    folder.mkdir()
    for f in embedded_model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    for i, name in enumerate(WEIGHTS):
        (folder / name).write_bytes(bytes([i]) * 4096)
    return folder


def test_a_store_tokenizer_fetches_no_weight_file(embedded_model: Path, tmp_path: Path) -> None:
    settings = GatewaySettings(home=tmp_path / "home")
    store = open_store(settings)
    base = store.publish(
        _base_folder(embedded_model, tmp_path / "base"),
        kind="base-model",
        name="llama-like",
        service="test",
    )
    tok = TokenizerCache(settings).load("llama-like")
    assert tok.hf.chat_template  # a working tokenizer, template included

    cached = {p.name for p in settings.resolved_cache_dir.rglob("*") if p.is_file()}
    weights = {f.sha256 for f in base.files if f.path in WEIGHTS}
    assert not cached & (set(WEIGHTS) | weights)  # neither the files nor their blobs
    folder = next((settings.resolved_cache_dir / "artifacts").glob("*-only-*[!n]"))
    assert {p.name for p in folder.iterdir()} == {
        f.path for f in base.files if f.path not in WEIGHTS
    }


def test_a_tampered_tokenizer_file_is_refused(embedded_model: Path, tmp_path: Path) -> None:
    """The selected files are verified like a whole fetch: a stored tokenizer.json whose
    bytes changed is not loaded."""
    settings = GatewaySettings(home=tmp_path / "home")
    store = open_store(settings)
    base = store.publish(
        _base_folder(embedded_model, tmp_path / "base"),
        kind="base-model",
        name="llama-like",
        service="test",
    )
    entry = next(f for f in base.files if f.path == "tokenizer.json")
    blob = store.backend.blob_path(entry.sha256)  # type: ignore[attr-defined]
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes().replace(b'"<|im_end|>"', b'"<|im_END|>"'))
    with pytest.raises(TokenizerUnavailable, match="corrupted"):
        TokenizerCache(settings).load("llama-like")


def test_a_failed_load_is_retried_after_a_backoff(embedded_model: Path, tmp_path: Path) -> None:
    settings = GatewaySettings(home=tmp_path / "home")
    now = [1000.0]  # seconds, the cache's clock: the test moves it
    cache = TokenizerCache(settings, clock=lambda: now[0])
    assert cache.due("later")
    with pytest.raises(TokenizerUnavailable):
        cache.load("later")  # not published yet
    failed = cache.failure("later")
    assert failed is not None and failed.attempts == 1 and not cache.due("later")
    # jitter in [0, 1): the first wait is RETRY_FIRST_S / 2 .. RETRY_FIRST_S
    assert now[0] + RETRY_FIRST_S / 2 <= failed.retry_at < now[0] + RETRY_FIRST_S
    open_store(settings).publish(
        _base_folder(embedded_model, tmp_path / "base"),
        kind="base-model",
        name="later",
        service="test",
    )
    now[0] = failed.retry_at
    assert cache.due("later")
    assert cache.load("later").hf.chat_template
    assert cache.failure("later") is None and not cache.due("later")


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [retry_delay(n, 0.999999) for n in (1, 2, 3)] == pytest.approx(
        [RETRY_FIRST_S, 2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S], rel=1e-5
    )
    assert retry_delay(40, 0.0) == RETRY_MAX_S / 2 and retry_delay(40, 0.999999) <= RETRY_MAX_S


def test_ready_is_503_while_a_served_model_has_no_tokenizer(
    fake: tuple[str, object], embedded_model: Path, tmp_path: Path
) -> None:
    url, _ = fake
    settings = GatewaySettings(
        home=tmp_path / "home",
        backends=[url],
        tokenizers={"smollm2": "smollm2-base"},  # a store ref, not published yet
        scrape_interval_s=0.1,
    )
    with serve_in_thread(create_app(settings), free_port()) as gw:

        def refused() -> bool:
            r = httpx.post(f"{gw}/v1/chat/completions", json=chat(), timeout=60)
            return r.status_code == 503 and "smollm2-base" in r.text

        wait_for(refused, "the model refused for want of its tokenizer", 30)
        ready = httpx.get(f"{gw}/ready")
        assert ready.status_code == 503 and not ready.json()["ready"]

        open_store(settings).publish(
            _base_folder(embedded_model, tmp_path / "base"),
            kind="base-model",
            name="smollm2-base",
            service="test",
        )
        # the next try after its backoff (at most RETRY_FIRST_S seconds) loads it: ready
        wait_for(lambda: httpx.get(f"{gw}/ready").status_code == 200, "ready", 30)
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat(), timeout=60).status_code == 200
