"""What the smoke and overfit runs change in the training recipe: which samples they
train on and with which schedule, and the verdict they end with. They publish nothing.

smoke: a fixed short batch for SMOKE_STEPS steps; passes when the loss fell by at least
SMOKE_MIN_DROP, the checkpoint reloads bit for bit and a greedy sample in the serving
format stops at the end-of-turn token. overfit: N samples until the loss is under
OVERFIT_LOSS (the data and masking can be learned at all).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainer.config import RunConfig, with_overrides
from trainer.data.preparation import Prepared
from trainer.data.samples import Sample, prompt_ids
from trainer.errors import SmokeFailed
from trainer.state import Components, Progress, RunPlan

SMOKE_STEPS = 8  # optimizer steps of a smoke run
SMOKE_SEQ = 128  # tokens: smoke runs use samples at most this long
SMOKE_MIN_DROP = 0.01  # the last loss must be at least 1% under the first
SMOKE_NEW_TOKENS = 48  # tokens generated for the smoke sample
OVERFIT_LOSS = 0.05  # nats/token: --overfit passes below this
OVERFIT_MAX_STEPS = 300


class Selection(NamedTuple):
    """What a mode runs with: its config and the samples it trains and validates on."""

    config: RunConfig  # smoke and overfit adjust steps and schedule
    train: list[Sample]
    val: list[Sample]


def select_samples(
    cfg: RunConfig, mode: str, overfit: int | None, train: list[Sample], val: list[Sample]
) -> Selection:
    """The config a mode runs with and the training and validation samples it takes."""
    if mode == "smoke":
        short = [s for s in train if s.length <= SMOKE_SEQ]
        want = cfg.micro_batch * cfg.grad_accum
        if not short:
            raise SmokeFailed(
                f"no training sample is at most {SMOKE_SEQ} tokens long",
                "smoke needs short samples",
            )
        cfg = with_overrides(
            cfg,
            [
                f"max_steps={SMOKE_STEPS}",
                "schedule=constant",
                "warmup_steps=0",
                f"checkpoint_every={SMOKE_STEPS}",
                f"eval_every={SMOKE_STEPS}",
                "keep_checkpoints=1",
                "epochs=10000",
            ],
        )
        val_short = [s for s in val if s.length <= SMOKE_SEQ][:want] or short[:1]
        return Selection(cfg, short[:want], val_short)
    if mode == "overfit":
        n = overfit or 1
        cfg = with_overrides(
            cfg,
            [
                f"max_steps={cfg.max_steps or OVERFIT_MAX_STEPS}",
                "schedule=constant",
                "epochs=10000",
                "checkpoint_every=1000000",
                "eval_every=1000000",
            ],
        )
        return Selection(cfg, train[:n], train[:n])
    return Selection(cfg, train, val)


class Check(NamedTuple):
    """One check of a smoke run: whether it passed and its line in the verdict."""

    ok: bool
    line: str

    @classmethod
    def of(cls, ok: bool, what: str) -> Check:
        return cls(ok, f"{'ok ' if ok else 'BAD'} {what}")


def smoke_checks(
    plan: RunPlan, prep: Prepared, components: Components, progress: Progress, last: Path | None
) -> list[Check]:
    """The smoke run's checks: the loss fell, the checkpoint `last` reloads, a greedy
    sample stops."""
    return [
        _loss_fell(progress),
        _checkpoint_reloads(last, components.peft),
        _sample_stops(plan, prep, components.peft),
    ]


def _loss_fell(progress: Progress) -> Check:
    first = progress.losses.get(1, float("nan"))
    last = progress.losses.get(progress.step, float("nan"))
    return Check.of(
        last < first * (1 - SMOKE_MIN_DROP),
        f"loss went down (by {SMOKE_MIN_DROP:.0%} at least): {first:.4f} -> {last:.4f}",
    )


def _checkpoint_reloads(last_checkpoint: Path | None, peft: Any) -> Check:
    reload_ok = False
    if last_checkpoint is not None:
        from safetensors.torch import load_file

        saved = load_file(str(last_checkpoint / "adapter" / "adapter_model.safetensors"))
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(peft)
        reload_ok = (
            bool(saved)
            and set(saved) == set(live)
            and all(torch.equal(saved[k], live[k].detach().cpu()) for k in saved)
        )
    return Check.of(reload_ok, f"checkpoint written and reloads: {last_checkpoint}")


def _sample_stops(plan: RunPlan, prep: Prepared, peft: Any) -> Check:
    conv = (prep.splits.validation or prep.splits.train)[0].conv
    ids = torch.tensor([prompt_ids(conv, prep.tokenizer)], device=plan.device)
    peft.eval()
    with torch.no_grad():
        out = peft.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=SMOKE_NEW_TOKENS,
            do_sample=False,
            eos_token_id=plan.eot,
            pad_token_id=plan.pad,
            use_cache=True,
        )
    new = out[0, ids.shape[1] :].tolist()
    stopped = bool(new) and new[-1] == plan.eot
    text = prep.tokenizer.decode(new, skip_special_tokens=True)
    return Check.of(
        bool(text.strip()) and stopped,
        f"sample in the serving format "
        f"({'stopped at end-of-turn' if stopped else f'no end-of-turn in {SMOKE_NEW_TOKENS} tokens'}): "
        f"{text.strip()[:80]!r} (expected {conv.messages[-1].flat_text[:40]!r})",
    )


def overfit_verdict(progress: Progress, samples: int) -> dict[str, Any]:
    """The overfit run's check: the last loss under OVERFIT_LOSS."""
    last = progress.losses.get(progress.step, float("inf"))
    return {
        "passed": last < OVERFIT_LOSS,
        "checks": [
            f"loss {last:.4f} after {progress.step} steps on {samples} samples "
            f"(pass below {OVERFIT_LOSS})"
        ],
    }


def verdict(
    plan: RunPlan,
    prep: Prepared,
    components: Components,
    progress: Progress,
    last_checkpoint: Path | None,
    series: dict[int, float],
) -> dict[str, Any] | None:
    """The verdict a smoke or overfit run ends with (None for a training run)."""
    if plan.mode == "smoke":
        checks = smoke_checks(plan, prep, components, progress, last_checkpoint)
        return {
            "passed": all(c.ok for c in checks),
            "checks": [c.line for c in checks],
            "losses": series,
        }
    if plan.mode == "overfit":
        return overfit_verdict(progress, len(plan.train_samples))
    return None


def say_verdict(mode: str, verdict: dict[str, Any], say: Callable[[str], None]) -> None:
    """Say PASS or FAIL for `mode`, then each check, one a line."""
    say(("PASS" if verdict["passed"] else "FAIL") + f" ({mode})")
    for c in verdict["checks"]:
        say(f"  {c}")


def refuse_failed(mode: str, verdict: dict[str, Any] | None) -> None:
    """SmokeFailed for a failing verdict, with its checks."""
    if verdict is not None and not verdict["passed"]:
        raise SmokeFailed(
            f"{mode} run failed:\n" + "\n".join(f"  {c}" for c in verdict["checks"]),
            "see the failing checks above; 'lorastack data inspect' shows what is supervised",
        )
