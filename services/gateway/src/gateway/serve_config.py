"""What an inference serve config tells the gateway: its vLLM's running slots, and the store
model behind the name it serves (the tokenizer to count its prompts with).

Owns: reading the file and those two figures, each raising ValueError that says what is
wrong (settings.py turns it into the setting's error). Does not own: the serve config's
schema (the inference service's), the settings object (settings.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lorastack.errors import LorastackError
from lorastack.manifest import served_name


def _serve_config(serve_config: Path) -> Any:
    """The file's YAML; ValueError saying why it cannot be read."""
    try:
        return yaml.safe_load(serve_config.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"serve_config {serve_config} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"serve_config {serve_config} is not valid YAML: {e}") from None


INFERENCE_MAX_NUM_SEQS = 8  # the inference service's default when its config sets none


def served_max_num_seqs(serve_config: Path) -> int:
    """The running slots an inference serve config gives its vLLM."""
    data = _serve_config(serve_config)
    n = data.get("max_num_seqs", INFERENCE_MAX_NUM_SEQS) if isinstance(data, dict) else None
    if type(n) is not int or n < 1:
        raise ValueError(f"serve_config {serve_config}: max_num_seqs must be an integer >= 1")
    return n


def served_tokenizers(serve_config: Path) -> dict[str, str]:
    """{served model name: store ref of its model} read from an inference serve config, the
    one place that maps the name clients send to the artifact behind it."""
    data = _serve_config(serve_config)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model:
        raise ValueError(f"serve_config {serve_config} names no model (model: NAME[:VERSION])")
    try:
        return {served_name(model, str(data.get("served_model_name") or "")): model}
    except LorastackError as e:
        raise ValueError(f"serve_config {serve_config}: {e}") from None
