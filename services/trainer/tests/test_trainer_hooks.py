"""Hooks run only after the results are verified in a store off this host: a file://
store refuses a hook unless it is allowed; a run on S3 (moto on loopback) runs on_complete
after the adapter, records and last checkpoint are read back and checked, with the refs
and the cost in its environment; an unreachable store or a damaged object means no hook,
and the message says why; a hook that fails or hangs is reported and loses nothing."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from lorastack.errors import ConfigError, StoreUnavailable
from lorastack.manifest import Manifest
from lorastack.store import ArtifactStore, open_store
from lorastack.store.backend import blob_key
from lorastack_testing.net import free_port
from lorastack_testing.s3 import s3_settings
from trainer.config import HookConfig, build_config, load_config
from trainer.errors import HookNotRun
from trainer.publish import hooks
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

BASE = "smollm2-135m-instruct"  # the trainer conftest's base model

# the hook a test runs: it finds the adapter in the store itself, checks every file, and
# writes the LORASTACK_* variables it was given to the marker file named by argv[1]
HOOK = """\
import json, os, sys
from lorastack.settings import CommonSettings
from lorastack.store import open_store
store = open_store(CommonSettings())
m = store.resolve(os.environ["LORASTACK_ADAPTER_REF"])
assert m.digest == os.environ["LORASTACK_ADAPTER_DIGEST"]
store.verify_remote(m)
env = {k: v for k, v in os.environ.items() if k.startswith("LORASTACK_")}
open(sys.argv[1], "w").write(json.dumps(env))
print("adapter", m.ref, "is in", store.url)
"""


def _hook(tmp_path: Path, **fields: object) -> tuple[dict[str, object], Path]:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    marker = tmp_path / "marker.json"
    return {"command": f"{sys.executable} {script} {marker}", **fields}, marker


def test_a_file_store_refuses_a_hook_unless_allowed() -> None:
    hook = {"command": "shutdown -h +1"}
    config = build_config({"dataset": {"path": "x.jsonl"}, "on_complete": hook})
    with pytest.raises(ConfigError, match="on_complete needs a store off this host") as e:
        hooks.refuse_local_store(config, "file:///srv/store")
    assert "on_complete.allow_local_store: true" in e.value.hint
    assert "LORASTACK_STORE_URL=s3://" in e.value.hint
    hooks.refuse_local_store(config, "s3://bucket/team")
    allowed = build_config(
        {"dataset": {"path": "x.jsonl"}, "on_failure": {**hook, "allow_local_store": True}}
    )
    hooks.refuse_local_store(allowed, "file:///mnt/nfs/store")
    assert hooks.store_warning("s3://b", "http://127.0.0.1:9000") is not None
    assert hooks.store_warning("s3://b", "https://s3.example.com") is None


def test_a_hook_that_fails_or_hangs_is_reported(tmp_path: Path) -> None:
    said: list[str] = []
    failed = hooks.run_hook(
        "on_complete",
        HookConfig(command="echo to-out; echo to-err >&2; exit 3"),
        {"PATH": "/usr/bin:/bin"},
        tmp_path,
        said.append,
    )
    assert failed.exit_code == 3 and not failed.ok
    assert "[on_complete] to-out" in said and "[on_complete] to-err" in said
    assert "exited 3" in said[-1] and (tmp_path / "on_complete.log").read_text().count("to-") == 2
    hung = hooks.run_hook(
        "on_failure",
        HookConfig(command="sleep 60 & wait", timeout_s=0.5),
        {"PATH": "/usr/bin:/bin"},
        tmp_path,
        said.append,
    )
    assert hung.exit_code is None and hung.seconds < 10 and "timed out" in hung.describe()


def _small_artifact(store: ArtifactStore, tmp_path: Path) -> Manifest:
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "a.json").write_text('{"loss": 0.5}\n')
    return store.publish(folder, kind="report", name="hk/records", service="trainer")


def test_verification_reads_every_file_back_and_refuses_a_damaged_one(
    tmp_path: Path, moto_endpoint: str
) -> None:
    settings = s3_settings(tmp_path / "home", moto_endpoint)
    store = open_store(settings)
    m = _small_artifact(store, tmp_path)
    said: list[str] = []
    hooks.verify_all(store, {"records": m}, "on_complete", said.append)
    assert said == [f"on_complete: verified hk/records:1 in {store.url} (every file's sha256)"]
    bucket, _, prefix = settings.store_url.removeprefix("s3://").partition("/")
    sha = m.files[0].sha256
    boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).put_object(Bucket=bucket, Key=f"{prefix}/{blob_key(sha)}", Body=b"damaged")
    with pytest.raises(HookNotRun, match=r"on_complete hook not run: hk/records:1 .*corrupted"):
        hooks.verify_all(store, {"records": m}, "on_complete", said.append)


def test_an_unreachable_store_means_no_hook(tmp_path: Path) -> None:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    store = open_store(s3_settings(tmp_path / "home", f"http://127.0.0.1:{port}"))
    m = _small_artifact(store, tmp_path)
    server.stop()
    with pytest.raises(HookNotRun, match=r"could not be verified .* failed 2 times") as e:
        hooks.verify_all(store, {"records": m}, "on_complete", print)
    assert "--resume auto" in e.value.hint


@pytest.fixture
def s3_env(
    trainer_env: TrainerSettings,
    store_home: Path,
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[str], TrainerSettings]]:
    """Trainer settings on a bucket of the test S3 server at `endpoint`. The bucket holds
    only the base model's manifest: its files are in the shared cache already (the 517 MB
    base is not copied again)."""
    local = open_store(trainer_env)
    base = local.resolve(BASE)
    local.fetch(base)

    def make(endpoint: str) -> TrainerSettings:
        s3 = s3_settings(store_home, moto_endpoint)
        open_store(s3).backend.put_manifest(base.name, base.version, base.to_json())
        for key, value in {
            "STORE_URL": s3.store_url,
            "S3_ENDPOINT_URL": endpoint,
            "S3_ACCESS_KEY_ID": "test",
            "S3_SECRET_ACCESS_KEY": "test",
            "S3_MAX_ATTEMPTS": "2",
        }.items():
            monkeypatch.setenv(f"LORASTACK_{key}", value)
        return TrainerSettings()

    yield make


@pytest.mark.slow
def test_on_complete_runs_after_the_verified_upload_with_refs_and_cost(
    s3_env: Callable[[str], TrainerSettings],
    moto_endpoint: str,
    tmp_path: Path,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = s3_env(moto_endpoint)
    hook, marker = _hook(tmp_path)
    path = write_config(
        "hooks-s3", demo_jsonl, on_complete=hook, price_per_gpu_hour=3.0, max_steps=2
    )
    result = run_training(load_config(path), settings)
    assert result.hook is not None and result.hook.ok, result.hook
    env = json.loads(marker.read_text())
    assert env["LORASTACK_RUN"] == "hooks-s3" and env["LORASTACK_STATUS"] == "complete"
    assert env["LORASTACK_ADAPTER_REF"] == "hooks-s3/adapter:1"
    assert env["LORASTACK_CHECKPOINT_REF"] == "hooks-s3/checkpoints:2"
    assert env["LORASTACK_DATA_REF"] == "hooks-s3/data:1"
    assert float(env["LORASTACK_COST_USD"]) == float(env["LORASTACK_COST"]) > 0
    out = capsys.readouterr().out
    verified = out.index("on_complete: verified hooks-s3/adapter:1")
    assert out.index("on_complete: verified hooks-s3/checkpoints:2") < out.index(
        "on_complete: running"
    )
    assert verified < out.index("[on_complete] adapter hooks-s3/adapter:1 is in s3://")
    assert "on_complete hook exited 0" in out


def test_with_the_store_unreachable_no_hook_runs_and_the_error_says_why(
    s3_env: Callable[[str], TrainerSettings],
    tmp_path: Path,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = s3_env(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    hook, marker = _hook(tmp_path)
    path = write_config("hooks-down", demo_jsonl, on_complete=hook, on_failure=hook)
    with pytest.raises(StoreUnavailable, match="failed 2 times"):
        run_training(load_config(path), settings)
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "on_complete hook not run: the run did not complete (StoreUnavailable)" in out
    assert "on_failure hook not run: the support memo is not in a store off this host" in out
