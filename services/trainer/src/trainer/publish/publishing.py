"""Where a run meets the artifact store: the checkpoint a resumed run continues from
(refused when the run changed), checkpoints and the adapter published, the best
checkpoint kept, the adapter `select` picks, a finished run left as it was, and the
stop at a cost cap (at a published checkpoint; the arithmetic is trainer.publish.budget).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorastack.errors import Conflict, NotFound
from lorastack.manifest import Manifest, sha256_file
from trainer.config import SAFE_TO_CHANGE
from trainer.data.chat_templates import chat_format_record
from trainer.errors import CostCapReached, ResumeRefused
from trainer.loop.selection import selected_step, standing
from trainer.metrics import write_json
from trainer.publish import budget, checkpoint
from trainer.publish.completion import train_result

if TYPE_CHECKING:
    from trainer.publish.completion import TrainResult
    from trainer.recipe import Recipe

log = logging.getLogger("trainer")
TEMPLATE_FILE = "chat_template.jinja"  # what the tokenizer's save_pretrained writes


def find_resume_point(r: Recipe, resume: bool) -> Path | None:
    """The checkpoint to continue from (None for a fresh run); refuses a mismatch."""
    if r.mode != "train":
        return None
    name = f"{r.config.output}/checkpoints"
    local = checkpoint.local_steps(r.ckpt_root)
    remote = [int(v) for v in r.prep.store.versions(name) if v.isdigit()]
    latest = max(local + remote, default=None)
    if not resume:
        if latest is not None:
            raise ResumeRefused(
                f"run {r.config.output!r} already has checkpoints (latest step {latest})",
                "continue it with --resume, or start a new run with another output name "
                "(output=NAME)",
            )
        return None
    if latest is None:
        raise NotFound(
            f"--resume: run {r.config.output!r} has no checkpoint", "start without --resume"
        )
    folder = checkpoint.step_dir(r.ckpt_root, latest)
    if latest not in local:
        r.prep.store.get(r.prep.store.manifest(name, str(latest)), folder)
    old = checkpoint.read_manifest(folder)
    changed = checkpoint.manifest_diff(old, r.run_manifest)
    if changed:
        raise ResumeRefused(
            f"--resume refused: this run differs from checkpoint step {latest}:\n"
            + "\n".join(f"  {c}" for c in changed),
            "restore what changed, or start a new run under another output name; only "
            f"{', '.join(sorted(SAFE_TO_CHANGE))} may change on resume",
        )
    return folder


def publish_checkpoint(r: Recipe, folder: Path) -> None:
    name = f"{r.config.output}/checkpoints"
    parents = [r.prep.base.as_parent("base")]
    if r.data_manifest is not None:
        parents.append(r.data_manifest.as_parent("dataset"))
    try:
        r.prep.store.publish(
            folder,
            kind="checkpoint",
            name=name,
            service="trainer",
            version=str(r.progress.step),
            parents=parents,
            config=r.config.model_dump(mode="json"),
            metadata={"step": r.progress.step, "total_steps": getattr(r, "total_steps", None)},
        )
    except Conflict:
        log.warning("%s:%d was already published; keeping that version", name, r.progress.step)
    versions = sorted(int(v) for v in r.prep.store.versions(name) if v.isdigit())
    keep = kept_best(r)
    for v in versions[: -r.config.keep_checkpoints]:
        if v != keep:
            r.prep.store.delete(name, str(v))


def kept_best(r: Recipe) -> int | None:
    """The checkpoint that keep_checkpoints never deletes: the best evaluation's."""
    return standing(r.progress.val_losses).best_step if r.config.select == "best_val_loss" else None


def select_adapter(r: Recipe) -> dict[str, Any]:
    """The step `select` picks (trainer.loop.selection), its checkpoint here (publish_adapter
    publishes that checkpoint's adapter: under FSDP the model holds shards)."""
    step, why = selected_step(r.progress.val_losses, r.config.select, r.progress.step)
    folder = checkpoint.step_dir(r.ckpt_root, step)
    if not folder.is_dir():  # resumed elsewhere: the store keeps it (_kept_best)
        name = f"{r.config.output}/checkpoints"
        r.prep.store.get(r.prep.store.manifest(name, str(step)), folder)
    r.say(f"publishing the adapter of step {step}: {why}")
    return {"step": step, "why": why}


def already_finished(r: Recipe) -> TrainResult | None:
    """A --resume of a run that had finished and published: nothing was trained, so the
    published adapter and the run's completion record stay as they are (no new version
    with this no-op session's wall time, memory and an empty final loss)."""
    if (
        r.mode != "train"
        or r.progress.resumed_at is None
        or r.progress.step != r.progress.resumed_at
    ):
        return None
    path = r.run_dir / "training-complete.json"
    try:
        completion = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if completion.get("steps") != r.progress.step or not completion.get("adapter_digest"):
        return None
    m = r.prep.store.find(f"{r.config.output}/adapter", completion["adapter_digest"])
    if m is None:
        return None
    r.say(f"the run had already finished at step {r.progress.step}; keeping {m.ref}")
    result = train_result(r, completion)
    result.adapter = m
    return result


def publish_adapter(r: Recipe, completion: dict[str, Any], plot: Path) -> Manifest:
    cfg = r.config
    folder = r.run_dir / "adapter"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(
        checkpoint.step_dir(r.ckpt_root, completion["selected"]["step"]) / "adapter", folder
    )
    adapter_cfg = folder / "adapter_config.json"
    data = json.loads(adapter_cfg.read_text())
    data["base_model_name_or_path"] = r.prep.base.ref  # a store ref, never a hub id or a local path
    adapter_cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    r.prep.tokenizer.save_pretrained(folder)  # tokenizer files and chat_template.jinja
    chat_format = chat_format_record(
        (folder / TEMPLATE_FILE).read_text("utf-8"),
        cfg.chat_template,
        TEMPLATE_FILE,
        trained_on_tools=any(item.conv.has_tools for item in r.prep.splits.train),
    )
    shutil.copytree(r.metrics_dir, folder / "metrics")
    shutil.copy(plot, folder / "loss.png")
    shutil.copy(r.run_dir / "run-manifest.json", folder / "run-manifest.json")
    shutil.copy(r.run_dir / "memory-estimate.json", folder / "memory-estimate.json")
    completion["adapter_sha256"] = sha256_file(folder / "adapter_model.safetensors")
    write_json(folder / "training-complete.json", completion)
    assert r.data_manifest is not None and r.test_manifest is not None
    m = r.prep.store.publish(
        folder,
        kind="adapter",
        name=f"{cfg.output}/adapter",
        service="trainer",
        parents=[r.prep.base.as_parent("base"), r.data_manifest.as_parent("dataset")],
        config=cfg.model_dump(mode="json"),
        metadata={
            "test_split": {"ref": r.test_manifest.ref, "digest": r.test_manifest.digest},
            "steps": r.progress.step,
            "selected_step": completion["selected"]["step"],
            "selected_because": completion["selected"]["why"],
            "final_val_loss": completion["final_val_loss"],
            "best_val_loss": completion["best_val_loss"],
            "lora_r": cfg.lora.r,
            "quantization": cfg.quantization,
            "chat_format": chat_format,
        },
    )
    r.say(f"published {m.ref} ({m.digest[:19]})")
    return m


def check_budget(r: Recipe, resume_from: Path | None) -> str:
    """The preflight of a capped run (trainer.publish.budget): its line, or PreflightRefused. A
    resumed run counts the steps and hours of its checkpoint (trainer-state.json)."""
    state: dict[str, Any] = {}
    if resume_from is not None:
        state = json.loads((resume_from / "trainer-state.json").read_text())
    return budget.check_preflight(
        r.meter.caps,
        steps_left=r.total_steps - int(state.get("step", 0)),
        timing=step_time(r),
        setup_hours=r.config.setup_hours,
        hours_so_far=float(state.get("wall_s", 0.0)) / 3600 + r.meter.hours(),
    )


def step_time(r: Recipe) -> tuple[float, str] | None:
    """Seconds per step for the cost estimate: the config's, else the steps this run took
    before it was resumed, else this output's smoke run's per token, times the tokens of
    this run's steps (a smoke run trains a short batch of short samples)."""
    if r.config.seconds_per_step is not None:
        return r.config.seconds_per_step, "seconds_per_step in the run config"
    tokens_per_step = sum(r.plan.lengths) / max(1, r.plan.steps_per_epoch())
    return budget.measured_step_time(r.metrics_dir, "this run") or budget.measured_step_time(
        r.run_dir / "smoke" / "metrics", "the smoke run", tokens_per_step
    )


def cap_reached(r: Recipe, over: list[str]) -> CostCapReached:
    """The stop at a cap, once the checkpoint of this step is published."""
    return budget.stop_error(
        r.meter.caps,
        r.meter,
        over,
        step=r.progress.step,
        total_steps=r.total_steps,
        checkpoint_ref=f"{r.config.output}/checkpoints:{r.progress.step}",
        command=r.command,
        setup_hours=r.config.setup_hours,
    )


def publish_support_bundle(r: Recipe, bundle: Path) -> Manifest | None:
    """The support memo into the store beside the run (`OUTPUT/support`, a report), so it
    outlives the host. A store that cannot take it (it may be the failure) is logged and
    never hides the original error; a failure before the store opened keeps the local file."""
    prep = getattr(r, "prep", None)  # None: the run failed before its store opened
    store = prep.store if prep is not None else None
    if store is None or not r.settings.is_main:
        return None
    folder = bundle.parent / "support"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(bundle, folder / bundle.name)
    try:
        m = store.publish(
            folder,
            kind="report",
            name=f"{r.config.output}/support",
            service="trainer",
            metadata={"step": r.progress.step, "mode": r.mode},
        )
    except Exception as e:  # the run's own error is the one to raise
        log.warning("the support bundle stays local (%s): the store refused it: %s", bundle, e)
        return None
    print(f"support bundle published: {m.ref}", flush=True)
    return m
