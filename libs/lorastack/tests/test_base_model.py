"""The embedded base model: converted from the GGUF on PyPI, loadable, and coherent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorastack.base_model import check_hf_folder
from lorastack.errors import ConfigError


@pytest.mark.slow
def test_converted_model_answers_a_chat_prompt(embedded_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model)
    assert tok.model_max_length == 8192
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((embedded_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_import_default_publishes_once(embedded_model: Path, home: Path) -> None:
    """Run through the CLI as a user would; a second import publishes nothing new."""
    env_cmd = [sys.executable, "-m", "lorastack.cli"]
    # Reuse the converted folder so the test does not convert twice.
    models = home / "models"
    models.mkdir(parents=True)
    gguf_sha = embedded_model.name.split("-")[-1]
    (models / f"smollm2-135m-instruct-{gguf_sha}").symlink_to(embedded_model)
    for _ in range(2):
        out = subprocess.run(
            [*env_cmd, "model", "import-default"], capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout)["version"] == "1"
    ls = subprocess.run([*env_cmd, "store", "ls"], capture_output=True, text=True, check=True)
    assert "smollm2-135m-instruct:1" in ls.stdout and "base-model" in ls.stdout


def test_tokenizer_only_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no weights"):
        check_hf_folder(tmp_path)
