"""`lorastack model import OWNER/NAME`: from a hub on loopback (lorastack_testing.fake_hub) into the
store, as a user runs it (HF_ENDPOINT, HF_TOKEN from the environment)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastack.cli import main
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_testing.fake_hub import FakeHub, make_tiny_model

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def hub(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> Iterator[FakeHub]:
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
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def _import(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["model", "import", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_import_downloads_weights_config_and_tokenizer_only(
    hub: FakeHub, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = _import(capsys, "acme/tiny-chat", "--name", "tiny")
    assert code == 0, err
    assert json.loads(out) | {"digest": None} == {
        "kind": "base-model", "name": "tiny", "version": "1", "digest": None,
    }  # fmt: skip
    commit = hub.repos["acme/tiny-chat"].commit
    assert f"--revision {commit}" in err  # says how to pin what it took
    store = open_store(CommonSettings())
    m = store.resolve("tiny")
    assert m.metadata["source"] == f"hub:acme/tiny-chat@{commit}"
    files = {f.path for f in m.files}
    assert "model.safetensors" in files and "config.json" in files
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert not files & {"pytorch_model.bin", "modeling_tiny.py", "README.md"}
    assert not any(p.startswith("original/") for p in files)
    got = store.get(m, home / "got")
    model = AutoModelForCausalLM.from_pretrained(got)
    tok = AutoTokenizer.from_pretrained(got)
    assert model.config.num_hidden_layers == 2 and tok.eos_token == "<|im_end|>"
    # The same import again publishes nothing new and downloads no weights again.
    hub.requests.clear()
    code, out, _ = _import(capsys, "acme/tiny-chat", "--name", "tiny", "--revision", commit)
    assert code == 0 and json.loads(out)["version"] == "1"
    assert not [r for r in hub.requests if r[1].endswith(".safetensors")]


def test_an_interrupted_download_resumes_where_it_stopped(
    hub: FakeHub, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = (tiny_model / "model.safetensors").stat().st_size
    hub.cut_once["model.safetensors"] = size // 2
    code, _, err = _import(capsys, "acme/tiny-chat", "--name", "tiny")
    assert code == 2 and "run the same command again" in err
    assert open_store(CommonSettings()).versions("tiny") == []  # nothing half-published
    hub.requests.clear()
    code, _, err = _import(capsys, "acme/tiny-chat", "--name", "tiny")
    assert code == 0, err
    ranges = [r[2] for r in hub.requests if r[1].endswith("model.safetensors") and r[0] == "GET"]
    assert ranges[-1] == f"bytes={size // 2}-"


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
    hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    token: str | None,
    args: list[str],
    expect: str,
) -> None:
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    code, _, err = _import(capsys, *args, "--name", "tiny")
    assert code == 2 and expect in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ("bin-only", "no *.safetensors weights"),
        ("remote-code", "never runs code from a model repo"),
    ],
)
def test_unsafe_repos_are_refused_and_nothing_is_published(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], change: str, expect: str
) -> None:
    folder = hub.repos["acme/tiny-chat"].folder
    if change == "bin-only":
        (folder / "model.safetensors").unlink()
    else:
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
        (folder / "config.json").write_text(json.dumps(config))
    code, _, err = _import(capsys, "acme/tiny-chat", "--name", "tiny")
    assert code == 3 and expect in err
    assert open_store(CommonSettings()).versions("tiny") == []
    assert not [r for r in hub.requests if r[1].endswith(".safetensors") and "/cdn/" in r[1]]


def test_revision_is_refused_for_a_local_folder(
    tiny_model: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _import(capsys, str(tiny_model), "--name", "tiny", "--revision", "main")
    assert code == 2 and "--revision applies to a repo id" in err
