"""The parity check's life cycle from the attacker's side: the real supervisor app with the
fake vLLM as its engine, whose greedy answers and log-probs a scorer decides
(`FakeState.scorer`). No client reaches an adapter before its verdict; a refused one, one
whose check cannot run (a hanging engine, a hostile reference) is unloaded with a 409 that
names why, and every outcome is a metric series; a model whose own reference cannot be read
is refused once, never restarted in a loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inference.main import create_app
from inference.parity import ParityVerdict
from inference.settings import InferenceSettings
from lorastack.manifest import Manifest
from lorastack.parity import CHECK_PREFIX, REFERENCE_FILE, ProbeRecord, Reference, Replay, judge
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_model
from lorastack_testing.net import free_port, wait_for

PROMPT = "alpha beta gamma"  # the fake's tokenizer: one token per word, id = its length
PROMPT_IDS = [5, 4, 5]
OUTPUT = [7, 8, 9, 2]
TRAINED = [-0.1, -0.2, -0.05, -0.01]  # nats, the trained model's log-prob of each
RUNNER_UP = 3  # the token each position's runner-up is, 3 nats behind
BASE = [-4.0, -5.0, -3.0, -2.0]  # the base alone's log-probs of OUTPUT (the control)


def reference() -> Reference:
    probe = ProbeRecord(
        messages=[{"role": "user", "content": PROMPT}],
        prompt_text=PROMPT,
        prompt_ids=PROMPT_IDS,
        output_ids=OUTPUT,
        output_logprobs=TRAINED,
        output_text="x",
        output_top=[{t: lp, RUNNER_UP: lp - 3.0} for t, lp in zip(OUTPUT, TRAINED, strict=True)],
        base_logprobs=BASE,
    )
    return Reference(
        recorded_by="trainer", dtype="float32", max_new_tokens=4, probes=[probe, probe]
    )


def trained(model: str, seq: list[int]) -> dict[int, float]:
    """The trained model: the reference's tokens with its own log-probs."""
    at = len(seq) - len(PROMPT_IDS)
    if at >= len(OUTPUT):
        return {2: -0.01}
    return {OUTPUT[at]: TRAINED[at], RUNNER_UP: TRAINED[at] - 3.0}


def half_applied(model: str, seq: list[int]) -> dict[int, float]:
    """The adapter at half its scale: the same greedy tokens, log-probs halfway to the
    base's (what the issue's reviewer saw pass in half precision)."""
    at = len(seq) - len(PROMPT_IDS)
    if at >= len(OUTPUT):
        return {2: -0.01}
    lp = (TRAINED[at] + BASE[at]) / 2
    return {OUTPUT[at]: lp, RUNNER_UP: lp - 0.5}


def publish_adapter(
    store: ArtifactStore, base: Manifest, folder: Path, name: str, ref_bytes: bytes | None
) -> Manifest:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "id": folder.name}))
    (folder / "adapter_model.safetensors").write_bytes(folder.name.encode())
    if ref_bytes is not None:
        (folder / REFERENCE_FILE).write_bytes(ref_bytes)
    return store.publish(
        folder, kind="adapter", name=name, service="test", parents=[base.as_parent("base")]
    )


class Engine(FakeEngine):
    """The fake vLLM with the scorer of the test (`Engine.scorer`), which also records
    the models vLLM listed whenever the check asked it."""

    scorer: Callable[[str, list[int]], dict[int, float]] = trained
    seen_while_checked: list[set[str]] = []  # noqa: RUF012 (reset per test)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        state = self.state

        def score(model: str, seq: list[int]) -> dict[int, float]:
            Engine.seen_while_checked.append({m["id"] for m in state.models})
            return type(self).scorer(model, seq)

        state.scorer = score


@pytest.fixture
def store(tmp_path: Path) -> tuple[ArtifactStore, Manifest]:
    store = open_store(CommonSettings(home=tmp_path / "home"))
    return store, publish_tiny_model(store, tmp_path / "model")


@pytest.fixture
def serve(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []
    Engine.scorer = trained
    Engine.seen_while_checked = []

    def start(**overrides: Any) -> TestClient:
        values = {
            "home": str(tmp_path / "home"), "model": "tiny", "engine": "cpu",
            "enable_lora": True, "port": free_port(), "supervisor_port": free_port(),
            "workdir": str(tmp_path / "w"), "label_refresh_s": 0,
        } | overrides  # fmt: skip
        app = create_app(InferenceSettings(**values), store=store[0], server_factory=Engine)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def ready(client: TestClient) -> TestClient:
    wait_for(lambda: client.get("/ready").status_code == 200, "ready")
    return client


def listed(client: TestClient) -> set[str]:
    """What the (fake) vLLM lists in /v1/models now."""
    engine = client.app.state.supervisor.server  # type: ignore[attr-defined]
    return {m["id"] for m in engine.state.models}


def asked_for(client: TestClient, name: str) -> int:
    """Completions any client asked of `name` from vLLM."""
    engine = client.app.state.supervisor.server  # type: ignore[attr-defined]
    return sum(b.get("model") == name for b in engine.state.calls("/completions"))


def test_an_adapter_is_served_under_its_name_only_after_it_passed(
    serve: Callable[..., TestClient], store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> None:
    st, base = store
    ref = reference().model_dump_json().encode()
    publish_adapter(st, base, tmp_path / "a", "good/adapter", ref)
    client = ready(serve())
    r = client.post("/admin/adapters", json={"ref": "good/adapter"})
    assert r.status_code == 201, r.text
    assert Engine.seen_while_checked, "the check asked vLLM nothing"
    # while it was checked, vLLM listed it under the private name only
    assert all("good/adapter-v1" not in seen for seen in Engine.seen_while_checked)
    assert all(any(m.startswith(CHECK_PREFIX) for m in s) for s in Engine.seen_while_checked)
    names = listed(client)
    assert "good/adapter-v1" in names and not any(m.startswith(CHECK_PREFIX) for m in names)
    verdict = client.get("/status").json()["parity"]["good/adapter-v1"]
    assert verdict["ok"] is True and verdict["control_ratio"] == 0.0, verdict
    metrics = client.get("/metrics").text
    assert 'lorastack_inference_parity_ok{model="good/adapter-v1"} 1.0' in metrics
    assert 'lorastack_inference_parity_checks_total{outcome="passed"} 1.0' in metrics


def test_status_names_every_field_of_a_verdict_as_the_verdict_writes_it(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> None:
    """/status's schema names and describes each field of a parity verdict: those
    lorastack.parity.Verdict.as_dict writes, in its order, and the check's seconds; the
    record kept shows exactly them (here a verdict whose greedy answers parted)."""
    parted = Replay(
        rendered_ids=PROMPT_IDS,
        encoded_ids=PROMPT_IDS,
        forced_logprobs=[-0.1, -0.2, -1.0, -0.01],
        forced_top1=[True, True, False, True],
        greedy_ids=[7, 8, RUNNER_UP, 2],
        forced_margins=[0.0, 0.0, 0.7, 0.0],
        forced_tokens=[7, 8, RUNNER_UP, 9],
        rendered_text=PROMPT,
    )
    verdict = judge("m", reference(), [parted, parted], served_dtype="float32")
    shown = {**verdict.as_dict(), "seconds": 0.25}
    assert shown["greedy_partings"] and shown["limits"], shown
    record = ParityVerdict.of(verdict).model_copy(update={"seconds": 0.25})
    assert json.loads(record.model_dump_json()) == shown
    assert list(record.model_dump()) == list(shown)
    settings = InferenceSettings(
        home=str(tmp_path / "home"), model="tiny", engine="cpu", workdir=str(tmp_path / "w")
    )
    schemas = create_app(settings, store=store[0], server_factory=Engine).openapi()
    schemas = schemas["components"]["schemas"]
    kinds = schemas["StatusBody"]["properties"]["parity"]["additionalProperties"]["anyOf"]
    assert [k["$ref"].rpartition("/")[2] for k in kinds] == [
        "ParityVerdict", "ParityNotRun", "ParityNoReference"
    ]  # fmt: skip
    fields = schemas["ParityVerdict"]["properties"]
    assert list(fields) == list(shown)
    assert all(f.get("description") for f in fields.values()), fields


def test_a_half_applied_adapter_is_refused_and_never_answers_a_client(
    serve: Callable[..., TestClient], store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> None:
    """Its greedy answers are the trained ones; only the control tells it apart."""
    st, base = store
    publish_adapter(
        st, base, tmp_path / "a", "half/adapter", reference().model_dump_json().encode()
    )
    Engine.scorer = half_applied
    client = ready(serve())
    r = client.post("/admin/adapters", json={"ref": "half/adapter"})
    assert r.status_code == 409, r.text
    assert "of the base model's distance from the trained one remains" in r.text
    names = listed(client)
    assert "half/adapter-v1" not in names and not any(m.startswith(CHECK_PREFIX) for m in names)
    assert asked_for(client, "half/adapter-v1") == 0  # no request ever reached it by name
    metrics = client.get("/metrics").text
    assert 'lorastack_inference_parity_ok{model="half/adapter-v1"} 0.0' in metrics
    assert 'lorastack_inference_parity_checks_total{outcome="refused"} 1.0' in metrics


def _nan(data: dict[str, Any]) -> None:
    data["probes"][0]["output_logprobs"][1] = float("nan")


def _short(data: dict[str, Any]) -> None:
    data["probes"][0]["output_logprobs"].pop()


def _future(data: dict[str, Any]) -> None:
    data["format"] = 3


def _empty(data: dict[str, Any]) -> None:
    data["probes"][1]["output_ids"] = []
    data["probes"][1]["output_logprobs"] = []


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_nan, "finite number"),
        (_short, "3 output_logprobs for 4 output_ids"),
        (_future, "format 3 is not one this lorastack reads"),
        (_empty, "at least 1 item"),
        (None, "is not a parity reference"),  # not JSON at all
    ],
)
def test_a_hostile_reference_refuses_the_adapter_with_its_cause(
    serve: Callable[..., TestClient],
    store: tuple[ArtifactStore, Manifest],
    tmp_path: Path,
    damage: Callable[[dict[str, Any]], None] | None,
    named: str,
) -> None:
    st, base = store
    data = json.loads(reference().model_dump_json())
    if damage is None:
        raw = b'{"format": 2, "probes": [tru'
    else:
        damage(data)
        raw = json.dumps(data).encode()  # json writes a NaN as NaN, as a careless writer would
    publish_adapter(st, base, tmp_path / "a", "bad/adapter", raw)
    client = ready(serve())
    r = client.post("/admin/adapters", json={"ref": "bad/adapter"})
    assert r.status_code == 409, r.text
    assert "could not run" in r.text and named in r.text, r.text
    names = listed(client)
    assert "bad/adapter-v1" not in names and not any(m.startswith(CHECK_PREFIX) for m in names)
    metrics = client.get("/metrics").text
    assert 'lorastack_inference_parity_ok{model="bad/adapter-v1"} 0.0' in metrics
    assert 'lorastack_inference_parity_checks_total{outcome="error_refused"} 1.0' in metrics


@pytest.mark.parametrize(("policy", "status"), [("refuse", 409), ("warn", 201)])
def test_a_hanging_engine_is_bounded_and_fails_closed_unless_warn(
    serve: Callable[..., TestClient],
    store: tuple[ArtifactStore, Manifest],
    tmp_path: Path,
    policy: str,
    status: int,
) -> None:
    """vLLM takes 3 s before any completion; the check may take 0.5 s in all."""
    st, base = store
    publish_adapter(
        st, base, tmp_path / "a", "slow/adapter", reference().model_dump_json().encode()
    )
    client = ready(serve(parity=policy, parity_timeout_s=0.5))
    client.app.state.supervisor.server.state.first_byte_delay_s = 3.0  # type: ignore[attr-defined]
    r = client.post("/admin/adapters", json={"ref": "slow/adapter"})
    assert r.status_code == status, r.text
    record = client.get("/status").json()["parity"]["slow/adapter-v1"]
    assert record["ok"] is None and record["served"] is (policy == "warn"), record
    assert "did not answer" in record["error"] or "ran out of time" in record["error"], record
    assert record["seconds"] < 3.0  # the 0.5 s deadline, not vLLM's 3 s, ended it
    assert ("slow/adapter-v1" in listed(client)) is (policy == "warn")
    outcome = "error_served" if policy == "warn" else "error_refused"
    metrics = client.get("/metrics").text
    assert f'lorastack_inference_parity_checks_total{{outcome="{outcome}"}} 1.0' in metrics
    assert 'lorastack_inference_parity_ok{model="slow/adapter-v1"} 0.0' in metrics


def test_a_model_whose_reference_is_damaged_is_refused_once(
    serve: Callable[..., TestClient], store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> None:
    """An explicit dtype (no reference is read to choose it): the damage is found by the
    check, which refuses the model and stops vLLM, instead of restarting it in a loop."""
    st, _ = store
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    (folder / REFERENCE_FILE).write_text('{"format": 9}')
    st.publish(folder, kind="base-model", name="damaged", service="test")
    client = serve(model="damaged", dtype="float32", restart_backoff_s=0.05)
    sup = client.app.state.supervisor  # type: ignore[attr-defined]
    wait_for(lambda: sup.state == "refused", "refused")
    status = client.get("/status").json()
    assert "format 9 is not one this lorastack reads" in status["last_error"], status
    assert client.get("/ready").status_code == 503
    assert sup._thread is not None
    sup._thread.join(timeout=10)  # the loop ended: nothing restarts it
    assert not sup._thread.is_alive() and sup.state == "refused"
    started = [e for e in Engine.started if e is sup.server]
    assert len(started) == 1 and not started[0].running  # stopped, started once
