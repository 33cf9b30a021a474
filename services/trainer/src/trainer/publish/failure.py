"""What a failed run leaves behind: the support memo (support-bundle.json, with the facts
of the run, written beside it and published to the store), the on_failure hook, and the
error to raise: a LorastackError as it is, TrainingOOM or TrainingCrashed for anything
unexpected. The training itself (trainer.recipe) never sees this path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lorastack.errors import LorastackError
from lorastack.manifest import Manifest
from trainer.data.preparation import Prepared
from trainer.data.samples import template_hash
from trainer.errors import TrainingCrashed, TrainingOOM
from trainer.loop.budget import Meter
from trainer.publish import hooks
from trainer.publish.publishing import publish_support_bundle
from trainer.readings import device_facts
from trainer.state import RunPlan
from trainer.support_bundle import OOM_HINT, LogTail, is_oom, write_support_bundle


def report_failure(
    plan: RunPlan,
    prep: Prepared | None,
    step: int,
    meter: Meter,
    tail: LogTail,
    say: Callable[[str], None],
    e: Exception,
) -> LorastackError:
    """The support memo, then the on_failure hook; the error to raise for `e`. `prep` is
    None when the run failed before its data was ready, `step` the last one finished."""
    error, memo = leave_support_memo(plan, prep, step, tail, e)
    store = prep.store if prep is not None else None
    try:
        hooks.after_failure(plan, store, step, meter, error, memo, dict(os.environ), say)
    except Exception as h:  # never hide the run's own error behind the hook's
        say(f"on_failure hook not run: {type(h).__name__}: {h}")
    return error


def run_facts(plan: RunPlan, prep: Prepared | None, step: int) -> dict[str, Any]:
    """What the support memo says of the run (trainer.support_bundle.write_support_bundle)."""
    cfg = plan.config
    facts: dict[str, Any] = {
        "step": step,
        "failing_step": step + 1,
        "max_seq_len": cfg.max_seq_len,
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "quantization": cfg.quantization,
        "config": cfg.model_dump(mode="json"),
    }
    try:
        facts |= device_facts(plan.device)
    except Exception:
        facts["device"] = str(plan.device)
    tok = prep.tokenizer if prep is not None else None
    if tok is not None:
        facts["template"] = {
            "name": type(tok).__name__,
            "hash": template_hash(tok),
            "text": getattr(tok, "chat_template", None),
        }
    return facts


def leave_support_memo(
    plan: RunPlan, prep: Prepared | None, step: int, tail: LogTail, e: Exception
) -> tuple[LorastackError, Manifest | None]:
    """A failed run's support memo, written and published beside the run (None: it stays
    local), and the error to raise: `e` itself, or TrainingOOM / TrainingCrashed for an
    unexpected one."""
    cfg = plan.config
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    bundle = write_support_bundle(
        plan.run_dir / "support-bundle.json",
        e,
        run_facts(plan, prep, step),
        list(tail.lines),
        dict(os.environ),
    )
    print(f"support bundle: {bundle}", flush=True)
    memo = publish_support_bundle(plan, prep.store if prep is not None else None, step, bundle)
    if isinstance(e, LorastackError):
        return e, memo
    if is_oom(e):
        return TrainingOOM(
            f"out of memory at step {step + 1} (micro_batch={cfg.micro_batch}, "
            f"max_seq_len={cfg.max_seq_len}); support bundle: {bundle}",
            OOM_HINT,
        ), memo
    return TrainingCrashed(
        f"training crashed at step {step + 1}: {type(e).__name__}: {e}\n  support bundle: {bundle}",
        "the bundle holds the traceback, versions and last log lines; attach it to a bug report",
    ), memo
