"""What a failed run leaves behind: the support memo (support-bundle.json, with the facts
of the run, written beside it and published to the store), the on_failure hook, and the
error to raise: a LorastackError as it is, TrainingOOM or TrainingCrashed for anything
unexpected. The training itself (trainer.recipe) never sees this path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lorastack.errors import LorastackError
from lorastack.manifest import Manifest
from trainer.data.samples import template_hash
from trainer.errors import TrainingCrashed, TrainingOOM
from trainer.metrics import OOM_HINT, device_facts, is_oom, write_support_bundle
from trainer.publish import hooks

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def report_failure(r: Recipe, e: Exception) -> LorastackError:
    """The support memo, then the on_failure hook; the error to raise for `e`."""
    error, memo = leave_support_memo(r, e)
    try:
        hooks.after_failure(r, error, memo, dict(os.environ))
    except Exception as h:  # never hide the run's own error behind the hook's
        r.say(f"on_failure hook not run: {type(h).__name__}: {h}")
    return error


def run_facts(r: Recipe) -> dict[str, Any]:
    """What the support memo says of the run (trainer.metrics.write_support_bundle)."""
    cfg = r.config
    facts: dict[str, Any] = {
        "step": r.progress.step,
        "failing_step": r.progress.step + 1,
        "max_seq_len": cfg.max_seq_len,
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "quantization": cfg.quantization,
        "config": cfg.model_dump(mode="json"),
    }
    try:
        facts |= device_facts(r.device)
    except Exception:
        facts["device"] = str(r.device)
    prep = getattr(r, "prep", None)  # None: the run failed before its data was ready
    tok = prep.tokenizer if prep is not None else None
    if tok is not None:
        facts["template"] = {
            "name": type(tok).__name__,
            "hash": template_hash(tok),
            "text": getattr(tok, "chat_template", None),
        }
    return facts


def leave_support_memo(r: Recipe, e: Exception) -> tuple[LorastackError, Manifest | None]:
    """A failed run's support memo, written and published beside the run (None: it stays
    local), and the error to raise: `e` itself, or TrainingOOM / TrainingCrashed for an
    unexpected one."""
    from trainer.publish.publishing import publish_support_bundle

    r.run_dir.mkdir(parents=True, exist_ok=True)
    bundle = write_support_bundle(
        r.run_dir / "support-bundle.json", e, run_facts(r), list(r.tail.lines), dict(os.environ)
    )
    print(f"support bundle: {bundle}", flush=True)
    memo = publish_support_bundle(r, bundle)
    if isinstance(e, LorastackError):
        return e, memo
    if is_oom(e):
        return TrainingOOM(
            f"out of memory at step {r.progress.step + 1} (micro_batch={r.config.micro_batch}, "
            f"max_seq_len={r.config.max_seq_len}); support bundle: {bundle}",
            OOM_HINT,
        ), memo
    return TrainingCrashed(
        f"training crashed at step {r.progress.step + 1}: {type(e).__name__}: {e}\n"
        f"  support bundle: {bundle}",
        "the bundle holds the traceback, versions and last log lines; attach it to a bug report",
    ), memo
