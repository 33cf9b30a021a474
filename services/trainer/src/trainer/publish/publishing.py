"""Where a run meets the artifact store: the checkpoint a resumed run continues from
(refused when the run changed), checkpoints and the adapter published, the best
checkpoint kept, the adapter `select` picks, a finished run left as it was, and the
support memo kept beside the run.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from lorastack.errors import Conflict, NotFound
from lorastack.manifest import Manifest, sha256_file
from lorastack.parity import control_distance
from lorastack.store import ArtifactStore
from trainer.config import SAFE_TO_CHANGE, RunConfig
from trainer.data.chat_templates import chat_format_record
from trainer.data.preparation import Prepared
from trainer.errors import ResumeRefused
from trainer.loop.selection import Selected, selected_step, standing
from trainer.publish import checkpoint, reference
from trainer.publish.completion import TrainResult, train_result
from trainer.records import write_json
from trainer.state import Progress, RunPlan

log = logging.getLogger("trainer")
TEMPLATE_FILE = "chat_template.jinja"  # what the tokenizer's save_pretrained writes


class PublishedAdapter(NamedTuple):
    """What publish_adapter returns: the adapter's manifest and the completion record as
    the adapter holds it (the run's, with the selected step and the weights' sha256)."""

    manifest: Manifest
    completion: dict[str, Any]


def find_resume_point(
    store: ArtifactStore,
    output: str,
    ckpt_root: Path,
    run_manifest: dict[str, Any],
    *,
    resume: bool,
) -> Path | None:
    """The checkpoint a "train" run continues from (None for a fresh run).

    Raises ResumeRefused when the run already has checkpoints but `resume` is off, or when
    `run_manifest` differs from the checkpoint's; NotFound on `resume` without one.
    """
    name = f"{output}/checkpoints"
    local = checkpoint.local_steps(ckpt_root)
    remote = [int(v) for v in store.versions(name) if v.isdigit()]
    latest = max(local + remote, default=None)
    if not resume:
        if latest is not None:
            raise ResumeRefused(
                f"run {output!r} already has checkpoints (latest step {latest})",
                "continue it with --resume, or start a new run with another output name "
                "(output=NAME)",
            )
        return None
    if latest is None:
        raise NotFound(f"--resume: run {output!r} has no checkpoint", "start without --resume")
    folder = checkpoint.step_dir(ckpt_root, latest)
    if latest not in local:
        store.get(store.manifest(name, str(latest)), folder)
    old = checkpoint.read_manifest(folder)
    changed = checkpoint.manifest_diff(old, run_manifest)
    if changed:
        raise ResumeRefused(
            f"--resume refused: this run differs from checkpoint step {latest}:\n"
            + "\n".join(f"  {c}" for c in changed),
            "restore what changed, or start a new run under another output name; only "
            f"{', '.join(sorted(SAFE_TO_CHANGE))} may change on resume",
        )
    return folder


def publish_checkpoint(
    plan: RunPlan,
    prep: Prepared,
    step: int,
    folder: Path,
    val_losses: dict[int, float],
    total_steps: int | None,
) -> None:
    """Publish the checkpoint of `step` (`total_steps`: None before setup has planned the
    steps) and delete the versions keep_checkpoints lets go, the best one kept."""
    name = f"{plan.config.output}/checkpoints"
    parents = [prep.base.as_parent("base")]
    if plan.data_manifest is not None:
        parents.append(plan.data_manifest.as_parent("dataset"))
    try:
        prep.store.publish(
            folder,
            kind="checkpoint",
            name=name,
            service="trainer",
            version=str(step),
            parents=parents,
            config=plan.config.model_dump(mode="json"),
            metadata={"step": step, "total_steps": total_steps},
        )
    except Conflict:
        log.warning("%s:%d was already published; keeping that version", name, step)
    versions = sorted(int(v) for v in prep.store.versions(name) if v.isdigit())
    keep = kept_best(plan.config, val_losses)
    for v in versions[: -plan.config.keep_checkpoints]:
        if v != keep:
            prep.store.delete(name, str(v))


def kept_best(cfg: RunConfig, val_losses: dict[int, float]) -> int | None:
    """The checkpoint that keep_checkpoints never deletes: the best evaluation's."""
    return standing(val_losses).best_step if cfg.select == "best_val_loss" else None


def select_adapter(
    plan: RunPlan, store: ArtifactStore, progress: Progress, say: Callable[[str], None]
) -> Selected:
    """The step `select` picks (trainer.loop.selection), its checkpoint here (publish_adapter
    publishes that checkpoint's adapter: under FSDP the model holds shards)."""
    selected = selected_step(progress.val_losses, plan.config.select, progress.step)
    folder = checkpoint.step_dir(plan.ckpt_root, selected.step)
    if not folder.is_dir():  # resumed elsewhere: the store keeps it (kept_best)
        name = f"{plan.config.output}/checkpoints"
        store.get(store.manifest(name, str(selected.step)), folder)
    say(f"publishing the adapter of step {selected.step}: {selected.why}")
    return selected


def already_finished(
    plan: RunPlan, prep: Prepared, progress: Progress, say: Callable[[str], None]
) -> TrainResult | None:
    """A --resume of a run that had finished and published: nothing was trained, so the
    published adapter and the run's completion record stay as they are (no new version
    with this no-op session's wall time, memory and an empty final loss)."""
    if plan.mode != "train" or progress.resumed_at is None or progress.step != progress.resumed_at:
        return None
    path = plan.run_dir / "training-complete.json"
    try:
        completion = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if completion.get("steps") != progress.step or not completion.get("adapter_digest"):
        return None
    m = prep.store.find(f"{plan.config.output}/adapter", completion["adapter_digest"])
    if m is None:
        return None
    say(f"the run had already finished at step {progress.step}; keeping {m.ref}")
    return train_result(plan, prep, progress, completion, adapter=m)


def _adapter_folder(plan: RunPlan, prep: Prepared, step: int, plot: Path) -> Path:
    """RUN_DIR/adapter, afresh: checkpoint `step`'s adapter (its base named by store ref),
    the tokenizer, the metrics, the loss `plot` and the run's records."""
    folder = plan.run_dir / "adapter"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(checkpoint.step_dir(plan.ckpt_root, step) / "adapter", folder)
    adapter_cfg = folder / "adapter_config.json"
    data = json.loads(adapter_cfg.read_text())
    data["base_model_name_or_path"] = prep.base.ref  # a store ref, never a hub id or a local path
    adapter_cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    prep.tokenizer.save_pretrained(folder)  # tokenizer files and chat_template.jinja
    shutil.copytree(plan.metrics_dir, folder / "metrics")
    shutil.copy(plot, folder / "loss.png")
    shutil.copy(plan.run_dir / "run-manifest.json", folder / "run-manifest.json")
    shutil.copy(plan.run_dir / "memory-estimate.json", folder / "memory-estimate.json")
    return folder


def _chat_format(cfg: RunConfig, prep: Prepared, folder: Path) -> dict[str, Any]:
    """What the adapter's manifest says of the chat template it was trained with."""
    return chat_format_record(
        (folder / TEMPLATE_FILE).read_text("utf-8"),
        cfg.chat_template,
        TEMPLATE_FILE,
        trained_on_tools=any(item.conv.has_tools for item in prep.splits.train),
    )


def publish_adapter(
    plan: RunPlan,
    prep: Prepared,
    record: dict[str, Any],
    selected: Selected,
    plot: Path,
    say: Callable[[str], None],
) -> PublishedAdapter:
    """Publish the selected checkpoint's adapter as `<output>/adapter`, with its tokenizer,
    chat format, parity reference, metrics, plot and run records. `record` is the run's
    completion record (trainer.publish.completion.record_completion); the adapter holds
    it with the selected step and the weights' sha256, and so does what this returns."""
    cfg = plan.config
    folder = _adapter_folder(plan, prep, selected.step, plot)
    chat_format = _chat_format(cfg, prep, folder)
    parity = record_parity_reference(plan, prep, folder, say)
    completion = {
        **record,
        "selected": selected._asdict(),
        "adapter_sha256": sha256_file(folder / "adapter_model.safetensors"),
    }
    write_json(folder / "training-complete.json", completion)
    assert plan.data_manifest is not None and plan.test_manifest is not None
    m = prep.store.publish(
        folder,
        kind="adapter",
        name=f"{cfg.output}/adapter",
        service="trainer",
        parents=[prep.base.as_parent("base"), plan.data_manifest.as_parent("dataset")],
        config=cfg.model_dump(mode="json"),
        metadata={
            "test_split": {"ref": plan.test_manifest.ref, "digest": plan.test_manifest.digest},
            "steps": record["steps"],
            "selected_step": selected.step,
            "selected_because": selected.why,
            "final_val_loss": record["final_val_loss"],
            "best_val_loss": record["best_val_loss"],
            "lora_r": cfg.lora.r,
            "quantization": cfg.quantization,
            "chat_format": chat_format,
            "parity_reference": parity,
        },
    )
    say(f"published {m.ref} ({m.digest[:19]})")
    return PublishedAdapter(m, completion)


def record_parity_reference(
    plan: RunPlan, prep: Prepared, folder: Path, say: Callable[[str], None]
) -> dict[str, Any] | None:
    """Write the adapter's parity reference into `folder` (trainer.publish.reference), on
    the model as trained: the run's device, dtype and quantisation. Returns what the
    manifest says of it (None when none was recorded)."""
    cfg = plan.config
    held_out = reference.pick_conversations(
        [item.conv for item in prep.splits.validation],
        [item.conv for item in prep.splits.test],
        3 * cfg.parity_probes,
    )
    conversations, spare = held_out[: cfg.parity_probes], held_out[cfg.parity_probes :]
    if not conversations:
        return None
    if cfg.distributed == "fsdp" and plan.settings.world_size > 1:
        say("parity reference: not recorded under FSDP (the whole model may not fit one GPU)")
        return None
    ref = reference.record_reference(
        base_dir=prep.base_dir,
        adapter_dir=folder,
        config=cfg,
        device=plan.device,
        tokenizer=prep.tokenizer,
        conversations=conversations,
        base_digest=prep.base.digest,
        spare=spare,
        say=say,
    )
    path = reference.write_reference(ref, folder)
    control = control_distance(ref.probes)
    say(
        f"parity reference: {len(ref.probes)} held-out prompts recorded in {ref.dtype}"
        f"{'' if ref.quantization == 'none' else ' on the ' + ref.quantization + ' base'}"
        + (
            f" on the unquantised base it is served on (trained on {ref.trained_quantization})"
            if ref.trained_quantization
            else ""
        )
        + ("" if control is None else f"; the base alone is {control:.2f} nats a token away")
    )
    return {
        "file": path.name,
        "probes": len(ref.probes),
        "dtype": ref.dtype,
        "quantization": ref.quantization,
        "trained_quantization": ref.trained_quantization or ref.quantization,
        "control_distance": None if control is None else round(control, 4),
    }


def publish_support_bundle(
    plan: RunPlan, store: ArtifactStore | None, step: int, bundle: Path
) -> Manifest | None:
    """The support memo into the store beside the run (`OUTPUT/support`, a report), so it
    outlives the host. A store that cannot take it (it may be the failure) is logged and
    never hides the original error; a failure before the store opened (`store` None)
    keeps the local file."""
    if store is None or not plan.settings.is_main:
        return None
    folder = bundle.parent / "support"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(bundle, folder / bundle.name)
    try:
        m = store.publish(
            folder,
            kind="report",
            name=f"{plan.config.output}/support",
            service="trainer",
            metadata={"step": step, "mode": plan.mode},
        )
    except Exception as e:  # the run's own error is the one to raise
        log.warning("the support bundle stays local (%s): the store refused it: %s", bundle, e)
        return None
    print(f"support bundle published: {m.ref}", flush=True)
    return m
