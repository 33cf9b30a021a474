"""The chat template and tool parser vLLM is started with, from what the served artifacts
record (inference.chat_format): the command built from a small store (a config-only model
folder and adapter folders of a few bytes), and the refusals. No vLLM runs here."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from inference.engine import VllmServer
from inference.main import prepare
from inference.settings import InferenceSettings
from inference.supervisor import Supervisor
from lorastack.errors import ConfigError, Refused
from lorastack.manifest import Manifest
from lorastack.store import open_store

BASE_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
TOOLS_TEMPLATE = BASE_TEMPLATE + "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>"
TOOLS_TEMPLATE += "{{ tool_calls }}</tool_call>"
OTHER_TEMPLATE = BASE_TEMPLATE + "{# another template #}"
SMOLLM2_SHAPE = {  # config.json of SmolLM2-135M, enough for the KV estimate (no weights)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 64,
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "dtype": "float32",
}  # fmt: skip


def _record(template: str, parser: str | None, name: str = "chatml-tools") -> dict[str, object]:
    return {
        "template": name,
        "template_file": "chat_template.jinja",
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "tools": parser is not None,
        "tool_call_parser": parser,
    }


@pytest.fixture(scope="module")
def chat_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base (SmolLM2's config.json, BASE_TEMPLATE), adapters: tools/adapter (TOOLS_TEMPLATE,
    hermes), plain/adapter (the base's template), other/adapter (OTHER_TEMPLATE),
    old/adapter (no record), and merged-tools (a merged model that records hermes)."""
    root = tmp_path_factory.mktemp("chatfmt")
    s = open_store(InferenceSettings(home=root / "home"))
    model = root / "base"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    (model / "chat_template.jinja").write_text(BASE_TEMPLATE)
    base = s.publish(model, kind="base-model", name="smollm2-135m-instruct", service="test")
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    s.publish(
        model, kind="merged-model", name="merged-tools", service="test",
        metadata={"chat_format": _record(TOOLS_TEMPLATE, "hermes")},
    )  # fmt: skip
    for name, template, parser in (
        ("tools", TOOLS_TEMPLATE, "hermes"),
        ("plain", BASE_TEMPLATE, None),
        ("other", OTHER_TEMPLATE, None),
        ("old", TOOLS_TEMPLATE, None),
    ):
        folder = root / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
        (folder / "chat_template.jinja").write_text(template)
        meta = {} if name == "old" else {"chat_format": _record(template, parser, name)}
        s.publish(
            folder, kind="adapter", name=f"{name}/adapter", service="test",
            parents=[base.as_parent("base")], metadata=meta,
        )  # fmt: skip
    return root / "home"


def _supervisor(home: Path, **values: object) -> Supervisor:
    values.setdefault("model", "smollm2-135m-instruct")
    settings = InferenceSettings(home=home, engine="cpu", **values)  # type: ignore[arg-type]
    store = open_store(settings)
    return Supervisor(settings, prepare(settings, store), store, server_factory=VllmServer)


def _command(home: Path, **values: object) -> list[str]:
    return _supervisor(home, **values)._new_server().command()


def _value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, cmd
    return cmd[cmd.index(flag) + 1]


def test_a_tool_adapter_on_the_base_brings_its_template_and_the_hermes_parser(
    chat_home: Path,
) -> None:
    cmd = _command(chat_home, adapters=["tools/adapter"])
    template = Path(_value(cmd, "--chat-template"))
    assert template.read_text() == TOOLS_TEMPLATE  # the adapter's own file, verified
    assert cmd.count("--enable-auto-tool-choice") == 1
    assert _value(cmd, "--tool-call-parser") == "hermes"


@pytest.mark.parametrize("adapters", [[], ["plain/adapter"], ["old/adapter"]])
def test_the_base_template_and_unrecorded_adapters_add_no_flag(
    chat_home: Path, adapters: list[str]
) -> None:
    cmd = _command(chat_home, adapters=adapters, enable_lora=True)
    for flag in ("--chat-template", "--enable-auto-tool-choice", "--tool-call-parser"):
        assert flag not in cmd


def test_a_merged_tool_model_gets_the_parser_and_keeps_its_own_template(
    chat_home: Path,
) -> None:
    sup = _supervisor(chat_home, model="merged-tools")
    cmd = sup._new_server().command()
    assert "--chat-template" not in cmd  # vLLM reads the merged folder's chat_template.jinja
    assert _value(cmd, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in cmd
    assert sup.status().chat_format["parser_from"] == "merged-tools:1"


def test_the_users_own_flags_win_and_are_not_doubled(chat_home: Path) -> None:
    mine = ["--chat-template", "/my/template.jinja", "--tool-call-parser=hermes"]
    cmd = _command(chat_home, adapters=["tools/adapter"], extra_vllm_args=mine)
    assert _value(cmd, "--chat-template") == "/my/template.jinja"
    assert "--tool-call-parser" not in cmd and cmd.count("--tool-call-parser=hermes") == 1
    assert cmd.count("--enable-auto-tool-choice") == 1


def test_another_tool_parser_than_the_trained_one_is_refused_at_start(
    chat_home: Path,
) -> None:
    with pytest.raises(ConfigError) as e:
        _command(
            chat_home, adapters=["tools/adapter"], extra_vllm_args=["--tool-call-parser", "mistral"]
        )
    assert "tools/adapter:1 was trained to write tool calls for the 'hermes' parser" in str(
        e.value.message
    )
    assert "remove --tool-call-parser mistral from extra_vllm_args" in e.value.hint


def test_adapters_trained_with_different_templates_cannot_share_a_server(
    chat_home: Path,
) -> None:
    with pytest.raises(ConfigError) as e:
        _command(chat_home, adapters=["tools/adapter", "other/adapter"])
    assert "tools/adapter:1" in e.value.message and "other/adapter:1" in e.value.message
    assert "separate servers" in e.value.hint and "--chat-template" in e.value.hint
    # one template given by the user: the user's choice, started as asked
    cmd = _command(
        chat_home,
        adapters=["tools/adapter", "other/adapter"],
        extra_vllm_args=["--chat-template", "/one.jinja"],
    )
    assert _value(cmd, "--chat-template") == "/one.jinja"


def test_an_adapter_loaded_later_is_refused_when_the_server_lacks_its_template(
    chat_home: Path,
) -> None:
    plain = _supervisor(chat_home, enable_lora=True)
    with pytest.raises(Refused) as e:
        plain.fetch_adapter("tools/adapter")
    assert "another chat template" in e.value.message
    assert "list it under adapters in the serve config and restart" in e.value.hint
    assert plain.fetch_adapter("plain/adapter").manifest.ref == "plain/adapter:1"
    tools = _supervisor(chat_home, adapters=["tools/adapter"])
    with pytest.raises(Refused, match="another chat template"):
        tools.fetch_adapter("plain/adapter")


def test_an_adapter_whose_folder_lost_its_recorded_template_is_refused(
    chat_home: Path, tmp_path: Path
) -> None:
    store = open_store(InferenceSettings(home=chat_home))
    m = store.resolve("tools/adapter")
    folder = tmp_path / "bad"
    shutil.copytree(store.fetch(m), folder)
    (folder / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    store.publish(
        folder, kind="adapter", name="bad/adapter", service="test",
        parents=m.parents, metadata=m.metadata,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="that its folder does not hold"):
        _command(chat_home, adapters=["bad/adapter"])


def test_recorded_reads_only_a_complete_record() -> None:
    from inference.chat_format import recorded

    def manifest(meta: dict[str, object]) -> Manifest:
        return Manifest.model_validate(
            {"kind": "adapter", "name": "a", "version": "1", "digest": "d", "files": [],
             "created": "now", "producer": {"service": "t"}, "metadata": meta}
        )  # fmt: skip

    assert recorded(manifest({})) is None
    assert recorded(manifest({"chat_format": "hermes"})) is None
    r = recorded(manifest({"chat_format": _record(TOOLS_TEMPLATE, "hermes")}))
    assert r is not None and r.tool_call_parser == "hermes" and r.ref == "a:1"
