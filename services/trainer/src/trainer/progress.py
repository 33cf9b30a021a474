"""What a run reports while it trains: the step record (metrics-step-N.json), the step
line or progress bar (with the cost so far), the live metrics (trainer.live), and the
facts and error of a support memo.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from lorastack.errors import LorastackError
from lorastack.manifest import Manifest
from trainer.errors import TrainingCrashed, TrainingOOM
from trainer.live import gpu_reading
from trainer.memory import human
from trainer.metrics import (
    OOM_HINT,
    device_facts,
    is_oom,
    memory_now,
    write_json,
    write_support_bundle,
)
from trainer.samples import template_hash

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def log_step(
    r: Recipe,
    loss: float,
    lr: float,
    grad_norm: float,
    tokens: int,
    dt: float,
    session_start: float,
    session_tokens: int,
) -> None:
    """Write the step record, show the step (line or bar), publish the live metrics."""
    elapsed = time.monotonic() - session_start
    tps = session_tokens / elapsed if elapsed > 0 else 0.0
    steps_done = max(1, len(r.losses))
    eta = (r.total_steps - r.step) * elapsed / steps_done
    mem = memory_now(r.device)
    record = {
        "step": r.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_total": r.tokens_seen,
        "tokens_per_s": tps,
        "step_time_s": dt,
        **mem,
    }
    if r.settings.is_main:
        write_json(r.metrics_dir / f"metrics-step-{r.step}.json", record)
    shown = mem.get("peak_allocated", mem.get("rss", 0))
    cost = r.meter.cost()
    line = (
        f"step {r.step}/{r.total_steps} loss {loss:.4f} lr {lr:.2e} gnorm {grad_norm:.3f} "
        f"tok/s {tps:.0f} step {dt:.2f}s eta {duration(eta)} mem {human(shown)}"
        + (f" cost {cost:.2f}" if r.config.price_per_gpu_hour else "")
        + (f"/{r.config.max_cost:g}" if r.config.max_cost else "")
    )
    values = {
        "step": r.step,
        "loss": loss,
        "learning_rate": lr,
        "tokens_per_second": tps,
        "tokens": r.tokens_seen,
        "supervised_tokens": r.supervised_seen,
        "gpu_memory_allocated_bytes": mem.get("peak_allocated", 0),
        "gpu_memory_reserved_bytes": mem.get("peak_reserved", 0),
        "eta_seconds": eta,
        "cost": cost,
        "max_cost": r.config.max_cost or 0.0,
        "elapsed_hours": r.meter.hours(),
        **gpu_reading(r.device),
    }
    r.say(line, show=r.live.step(values, line))


def facts(r: Recipe) -> dict[str, Any]:
    """What the support memo says of the run (trainer.metrics.write_support_bundle)."""
    cfg = r.config
    facts: dict[str, Any] = {
        "step": r.step,
        "failing_step": r.step + 1,
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
    tok = getattr(r, "tokenizer", None)
    if tok is not None:
        facts["template"] = {
            "name": type(tok).__name__,
            "hash": template_hash(tok),
            "text": getattr(tok, "chat_template", None),
        }
    return facts


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def failed(r: Recipe, e: Exception) -> tuple[LorastackError, Manifest | None]:
    """A failed run's support memo, written and published beside the run (None: it stays
    local), and the error to raise: `e` itself, or TrainingOOM / TrainingCrashed for an
    unexpected one."""
    from trainer.publishing import publish_support_bundle

    r.run_dir.mkdir(parents=True, exist_ok=True)
    bundle = write_support_bundle(
        r.run_dir / "support-bundle.json", e, facts(r), list(r.tail.lines), dict(os.environ)
    )
    print(f"support bundle: {bundle}", flush=True)
    memo = publish_support_bundle(r, bundle)
    if isinstance(e, LorastackError):
        return e, memo
    if is_oom(e):
        return TrainingOOM(
            f"out of memory at step {r.step + 1} (micro_batch={r.config.micro_batch}, "
            f"max_seq_len={r.config.max_seq_len}); support bundle: {bundle}",
            OOM_HINT,
        ), memo
    return TrainingCrashed(
        f"training crashed at step {r.step + 1}: {type(e).__name__}: {e}\n"
        f"  support bundle: {bundle}",
        "the bundle holds the traceback, versions and last log lines; attach it to a bug report",
    ), memo
