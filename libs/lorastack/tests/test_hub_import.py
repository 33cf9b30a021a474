"""`lorastack model import OWNER/NAME`: from a hub on loopback (lorastack_testing.fake_hub,
which speaks what huggingface_hub asks) into the store, run as a user runs it: its own
process, HF_ENDPOINT and HF_TOKEN from the environment, HF_HUB_OFFLINE unset for it alone
(every test process has it set, and huggingface_hub reads it once, at import)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from lorastack.base_model import publish_if_new
from lorastack.manifest import sha256_file
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_testing.fake_hub import FakeHub, make_tiny_model

TOKEN = "hf_test_token"
CHUNK = hf_constants.DOWNLOAD_CHUNK_SIZE  # bytes (10 MiB): a download is written in these


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def hub(tiny_model: Path, tmp_path: Path, home: Path) -> Iterator[FakeHub]:
    """A gated repo `acme/tiny-chat`: the model plus what an import must leave behind."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model, repo)
    (repo / "pytorch_model.bin").write_bytes(b"pickled weights: never downloaded")
    (repo / "modeling_tiny.py").write_text("raise SystemExit('repo code ran')\n")
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.safetensors").write_bytes(b"x" * 10)
    (repo / "README.md").write_text("# tiny chat\n")
    with FakeHub() as server:
        server.add("acme/tiny-chat", repo, token=TOKEN)
        yield server


def _env(hub: FakeHub, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")
    }
    env |= {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home / "hf-home"),  # no stored login from the machine's user
        "LORASTACK_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorastack.cli", "model", "import", *args]


def _import(
    hub: FakeHub, home: Path, *args: str, **env: str | None
) -> subprocess.CompletedProcess[str]:
    full = _env(hub, home, token=env.pop("token", TOKEN))
    full |= {k: v for k, v in env.items() if v is not None}
    return subprocess.run(_cmd(*args), env=full, capture_output=True, text=True, check=False)


def test_import_downloads_weights_config_and_tokenizer_only(hub: FakeHub, home: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hub.page_size = 3  # the tree listing comes in pages: the library follows the Link header
    done = _import(hub, home, "acme/tiny-chat", "--name", "tiny")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) | {"digest": None} == {
        "kind": "base-model", "name": "tiny", "version": "1", "digest": None,
    }  # fmt: skip
    commit = hub.repos["acme/tiny-chat"].commit
    assert f"--revision {commit}" in done.stderr  # says how to pin what it took
    store = open_store(CommonSettings(home=home))
    m = store.resolve("tiny")
    assert m.metadata["source"] == f"hub:acme/tiny-chat@{commit}"
    files = {f.path for f in m.files}
    assert "model.safetensors" in files and "config.json" in files
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert not files & {"pytorch_model.bin", "modeling_tiny.py", "README.md"}
    assert not any(p.startswith("original/") for p in files)
    # every file came from the one commit, never from the branch name
    resolved = [p for _, p, _ in hub.requests if "/resolve/" in p]
    assert resolved and all(f"/resolve/{commit}/" in p for p in resolved)
    assert not [p for _, p, _ in hub.requests if p.endswith((".bin", ".py", "README.md"))]
    assert hub.cdn_authorization == []  # the token stays with the hub, never the CDN
    got = store.get(m, home / "got")
    model = AutoModelForCausalLM.from_pretrained(got)
    tok = AutoTokenizer.from_pretrained(got)
    assert model.config.num_hidden_layers == 2 and tok.eos_token == "<|im_end|>"
    # The same import again, pinned, publishes nothing new and downloads no weights again.
    hub.requests.clear()
    again = _import(hub, home, "acme/tiny-chat", "--name", "tiny", "--revision", commit)
    assert again.returncode == 0 and json.loads(again.stdout)["version"] == "1", again.stderr
    assert not [r for r in hub.requests if r[1].endswith(".safetensors")]


def _big_weights(hub: FakeHub) -> tuple[Path, int]:
    """A second weights file over two of the library's write chunks, so a cut mid-file
    leaves whole chunks written (it resumes from the last chunk it wrote)."""
    big = hub.repos["acme/tiny-chat"].folder / "extra.safetensors"
    size = 2 * CHUNK + 12345  # bytes
    big.write_bytes(bytes(range(256)) * (size // 256) + b"\1" * (size % 256))
    return big, size


def test_an_interrupted_download_resumes_where_it_stopped(hub: FakeHub, home: Path) -> None:
    big, size = _big_weights(hub)
    hub.cut_once["extra.safetensors"] = CHUNK + CHUNK // 2  # the connection drops here
    done = _import(hub, home, "acme/tiny-chat", "--name", "tiny")
    assert done.returncode == 0, done.stderr
    gets = [r[2] for r in hub.requests if r[0] == "GET" and r[1].endswith("extra.safetensors")]
    assert gets == [None, f"bytes={CHUNK}-"]  # the second asks only for what was missing
    m = open_store(CommonSettings(home=home)).resolve("tiny")
    entry = next(f for f in m.files if f.path == "extra.safetensors")
    assert (entry.size, entry.sha256) == (size, sha256_file(big))


def test_an_oversized_partial_file_is_not_resumed(hub: FakeHub, home: Path) -> None:
    # what an interrupted or hostile earlier run left: partial files one byte longer than
    # the remote file, where this and older versions of either tool kept them
    weights = hub.repos["acme/tiny-chat"].folder / "model.safetensors"
    data = weights.read_bytes()
    commit = hub.repos["acme/tiny-chat"].commit
    cache = home / "models" / "hub" / "models--acme--tiny-chat"
    (cache / "blobs").mkdir(parents=True)
    (cache / "blobs" / f"{sha256_file(weights)}.incomplete").write_bytes(data + b"!")
    old = home / "models" / "hub" / "acme--tiny-chat" / commit / "model.safetensors.part"
    old.parent.mkdir(parents=True)
    old.write_bytes(data + b"!")
    for attempt in range(2):  # and it does not fail on every rerun
        done = _import(hub, home, "acme/tiny-chat", "--name", "tiny")
        assert done.returncode == 0, (attempt, done.stderr)
    gets = [r for r in hub.requests if r[0] == "GET" and r[1].endswith("model.safetensors")]
    assert [r[2] for r in gets] == [None]  # one whole download, no Range from a stale part
    m = open_store(CommonSettings(home=home)).resolve("tiny")
    entry = next(f for f in m.files if f.path == "model.safetensors")
    assert entry.size == len(data) and entry.sha256 == sha256_file(weights)


def test_a_download_that_finally_fails_says_so_and_publishes_nothing(
    hub: FakeHub, home: Path
) -> None:
    hub.cdn_status["model.safetensors"] = 503  # every time: the library does not retry it
    done = _import(hub, home, "acme/tiny-chat", "--name", "tiny")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"the model hub at {hub.url} answered 503 for acme/tiny-chat@" in done.stderr
    assert "hint: try again later; a download continues" in done.stderr
    store = open_store(CommonSettings(home=home))
    assert store.backend.list_manifests("") == []  # nothing published, not even in part
    assert not [p for p in (home / "store").rglob("*") if p.is_file()]


def test_two_imports_of_one_repo_at_once_publish_one_version(hub: FakeHub, home: Path) -> None:
    # the hub holds both imports' first request until both have sent it, so they overlap
    hub.barrier = threading.Barrier(2, timeout=120)
    procs = [
        subprocess.Popen(
            _cmd("acme/tiny-chat", "--name", "tiny"),
            env=_env(hub, home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "Traceback" not in err, err
        assert json.loads(out)["version"] == "1"
    assert open_store(CommonSettings(home=home)).versions("tiny") == ["1"]
    assert not list((home / "models" / "hub").rglob("*.incomplete"))


def test_racing_publishes_of_the_same_content_make_one_version(tmp_path: Path) -> None:
    # four writers, released together, publish the same folder: whatever the interleaving,
    # the store's exclusive create gives one version and the others find it
    store = open_store(CommonSettings(home=tmp_path / "home"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    start = threading.Barrier(4, timeout=60)
    refs: list[str] = []

    def publish() -> None:
        start.wait()
        refs.append(publish_if_new(store, folder, "tiny", {}).ref)

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert refs == ["tiny:1"] * 4 and store.versions("tiny") == ["1"]


def test_the_same_bytes_again_are_the_latest_version_not_a_new_one(tmp_path: Path) -> None:
    store = open_store(CommonSettings(home=tmp_path / "home"))
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, text in ((a, "{}"), (b, '{"x": 1}')):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    assert publish_if_new(store, a, "m", {}).ref == "m:1"
    assert publish_if_new(store, a, "m", {}).ref == "m:1"  # nothing new
    assert publish_if_new(store, b, "m", {}).ref == "m:2"
    # back to a's bytes: they become the latest (a rollback), as a new version
    assert publish_if_new(store, a, "m", {}).ref == "m:3"
    assert store.resolve("m").ref == "m:3"


@pytest.mark.parametrize(
    ("token", "args", "expect"),
    [
        (None, ["acme/tiny-chat"], "HF_TOKEN"),  # gated, no token
        ("wrong", ["acme/tiny-chat"], "refused access"),
        (TOKEN, ["acme/no-such-model"], "not found on the model hub"),
        (TOKEN, ["acme/tiny-chat", "--revision", "v9"], "revision not found"),
    ],
)
def test_access_and_lookup_errors_say_what_to_change(
    hub: FakeHub, home: Path, token: str | None, args: list[str], expect: str
) -> None:
    done = _import(hub, home, *args, "--name", "tiny", token=token)
    assert done.returncode == 2 and expect in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not [r for r in hub.requests if "/resolve/" in r[1] or "/cdn/" in r[1]]


def test_offline_mode_is_named(hub: FakeHub, home: Path) -> None:
    done = _import(hub, home, "acme/tiny-chat", "--name", "tiny", HF_HUB_OFFLINE="1")
    assert done.returncode == 2 and "HF_HUB_OFFLINE" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and hub.requests == []


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ("bin-only", "no *.safetensors weights"),
        ("remote-code", "never runs code from a model repo"),
    ],
)
def test_unsafe_repos_are_refused_and_nothing_is_published(
    hub: FakeHub, home: Path, change: str, expect: str
) -> None:
    folder = hub.repos["acme/tiny-chat"].folder
    if change == "bin-only":
        (folder / "model.safetensors").unlink()
    else:
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
        (folder / "config.json").write_text(json.dumps(config))
    done = _import(hub, home, "acme/tiny-chat", "--name", "tiny")
    assert done.returncode == 3 and expect in done.stderr, done.stderr
    assert open_store(CommonSettings(home=home)).versions("tiny") == []
    assert not [r for r in hub.requests if r[1].endswith(".safetensors")]


def test_revision_is_refused_for_a_local_folder(
    tiny_model: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lorastack.cli import main

    code = main(["model", "import", str(tiny_model), "--name", "tiny", "--revision", "main"])
    assert code == 2 and "--revision applies to a repo id" in capsys.readouterr().err
