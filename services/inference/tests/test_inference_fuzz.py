"""Hostile input, generated (hypothesis), against the supervisor's own routes: every answer
is below 500 and every error is in the OpenAI shape with a hint, FastAPI's
`{"detail": [...]}` included. The supervisor is built for the embedded model and served
in-process, with vLLM never started (no lifespan): the routes' input handling is the
subject here, vLLM is test_inference_serving.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from inference.main import create_app, prepare
from inference.settings import InferenceSettings
from lorastack.store import open_store

EXAMPLES = 400

texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
bodies = st.one_of(
    st.fixed_dictionaries({"ref": st.one_of(texts, json_values)}),
    json_values,
).map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass"))
raw_bodies = st.one_of(
    bodies,
    st.binary(max_size=64),
    st.sampled_from([b"[" * 5000 + b"]" * 5000, b'{"ref": ' + b"9" * 5000 + b"}", b'{"ref": NaN}']),
    st.just(b'{"ref": "' + b"a" * 70_000 + b'"}'),  # over the body limit
)


@pytest.fixture(scope="module")
def client(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    home = tmp_path_factory.mktemp("fuzz-home")
    cfg = InferenceSettings(home=home, model="smollm2-135m-instruct", engine="cpu")
    store = open_store(cfg)
    store.publish(embedded_model, kind="base-model", name="smollm2-135m-instruct", service="test")
    app = create_app(cfg, plan=prepare(cfg, store), store=store)
    return TestClient(app, raise_server_exceptions=False)  # no `with`: vLLM never starts


def _check(r, sent: object) -> None:  # type: ignore[no-untyped-def]
    assert r.status_code < 500, f"{r.status_code} for {sent!r}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        assert {"type", "param", "code", "hint"} <= set(err), r.text
        assert "detail" not in r.json()


def test_generated_admin_requests_never_get_a_5xx(client: TestClient) -> None:
    sent = {"n": 0}

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        raw=raw_bodies,
        ctype=st.sampled_from([None, "application/json", "text/plain", "application/xml"]),
        method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
        path=st.sampled_from(["/admin/adapters", "/admin/adapters/x/y", "/status", "/nope"]),
    )
    def one(raw: bytes, ctype: str | None, method: str, path: str) -> None:
        headers = {"content-type": ctype} if ctype else {}
        r = client.request(method, path, content=raw, headers=headers)
        sent["n"] += 1
        _check(r, (method, path, ctype, raw[:200]))

    one()
    assert sent["n"] >= EXAMPLES


@pytest.mark.parametrize(
    ("raw", "ctype", "status", "words"),
    [
        (b'{"ref": "\\ud800"}', "application/json", 400, "lone UTF-16 surrogate"),
        (b"[" * 5000 + b"]" * 5000, "application/json", 400, "deep"),
        (b'{"ref": 5}', "application/json", 400, "ref: Input should be a valid string"),
        (b"{}", "application/json", 400, "ref: Field required"),
        (b'{"ref": "x"}', "text/plain", 415, "Content-Type: application/json"),
        (b'{"ref": "' + b"a" * 70_000 + b'"}', "application/json", 413, "limit"),
    ],
)
def test_bad_admin_bodies_say_what_to_change(
    client: TestClient, raw: bytes, ctype: str, status: int, words: str
) -> None:
    r = client.post("/admin/adapters", content=raw, headers={"content-type": ctype})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] + " " + err["hint"], err
    assert err["code"] == status


def test_unknown_route_and_method_use_the_same_error_shape(client: TestClient) -> None:
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = client.put("/status")
    assert r.status_code == 405 and "PUT /status" in r.json()["error"]["message"]
