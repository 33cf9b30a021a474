"""The evaluation report: its data (`EvalReport`), its Markdown, and the files written.

An evaluation folder holds three files, enough for someone else to re-check it:

    samples.jsonl   one line per test item: both prompts, both outputs, every score
    report.json     `EvalReport`: config, data provenance, per-metric bootstrap and verdict
    report.md       the same for people, with what the evidence cannot show

Numbers from training, validation and this test are kept in separate sections, each
naming the data (artifact ref and digest) it came from.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from evaluation.eval_config import EvalConfig
from evaluation.eval_data import DataSource, TestSet, TrainingEvidence
from evaluation.verdict import PairedResult, minimum_items

SMALL_N = 30  # below this many items a CI from the bootstrap is itself unreliable


class Answer(BaseModel):
    """One model's answer to one item: output, finish reason, error, timing, tokens, scores."""

    model: str
    output: str
    finish_reason: str = ""
    error: str = ""
    latency_s: float = 0.0  # seconds, request to full answer
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    scores: dict[str, float] = {}


class Sample(BaseModel):
    """One test item: the reference, both prompts as sent and both answers."""

    index: int
    reference: str
    baseline_prompt: list[dict[str, Any]]  # as sent (tool chats: tool_calls, null content)
    lora_prompt: list[dict[str, Any]]  # as sent (tool chats: tool_calls, null content)
    baseline: Answer
    lora: Answer


class SideSummary(BaseModel):
    """One side's totals: its model, failed and truncated answers, mean latency."""

    model: str
    errors: int  # requests that failed after retries (scored 0)
    truncated: int  # answers cut at max_tokens (finish_reason "length")
    mean_latency_s: float


class EvalReport(BaseModel):
    """An evaluation's result: the config, the data, each side's totals, the paired result of
    each metric and the limits of the evidence."""

    created: str
    config: dict[str, Any]  # the EvalConfig without the API key
    n: int
    test: DataSource
    adapter: TrainingEvidence | None
    baseline: SideSummary
    lora: SideSummary
    metrics: dict[str, PairedResult]
    limits: list[str]
    elapsed_s: float
    published: str = ""

    @property
    def verdicts(self) -> dict[str, str]:
        return {k: v.verdict for k, v in self.metrics.items()}


def _side(samples: list[Sample], which: str) -> SideSummary:
    answers = [getattr(s, which) for s in samples]
    return SideSummary(
        model=answers[0].model,
        errors=sum(bool(a.error) for a in answers),
        truncated=sum(a.finish_reason == "length" for a in answers),
        mean_latency_s=sum(a.latency_s for a in answers) / len(answers),
    )


def evidence_limits(config: EvalConfig, n: int, base: SideSummary, lora: SideSummary) -> list[str]:
    """What this evaluation cannot show, in plain words."""
    limits = [
        f"Sample size n = {n}: a difference smaller than the CI width cannot be told from noise"
        + (f"; with n < {SMALL_N} the interval itself is rough." if n < SMALL_N else "."),
        "One task and one frozen test split, drawn like the training data: nothing here says "
        "how either model does on other tasks or on data unlike this split.",
        f"Greedy decoding (temperature 0) with max_tokens = {config.max_tokens} only: sampled "
        "outputs or longer answers may rank differently.",
        "Automatic string scorers only: no human judged correctness, helpfulness or style.",
        "The baseline is one prompt (the system prompt / few-shot given); a better prompt "
        "might close the gap.",
        f"{len(config.scorers)} metric(s), each with its own {config.confidence:.0%} interval "
        "and no correction for multiple comparisons.",
    ]
    if base.errors or lora.errors:
        limits.append(
            f"Failed requests scored 0: {base.errors} baseline, {lora.errors} LoRA; "
            "these are not model errors."
        )
    if base.truncated or lora.truncated:
        limits.append(
            f"Answers cut at max_tokens: {base.truncated} baseline, {lora.truncated} LoRA."
        )
    return limits


def build_report(
    config: EvalConfig,
    test: TestSet,
    evidence: TrainingEvidence | None,
    samples: list[Sample],
    results: dict[str, PairedResult],
    *,
    elapsed_s: float,
) -> EvalReport:
    """The report of a finished evaluation (the config without its API key)."""
    base, lora = _side(samples, "baseline"), _side(samples, "lora")
    return EvalReport(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        config=config.model_dump(mode="json", exclude={"api_key"}),
        n=len(samples),
        test=test.source,
        adapter=evidence,
        baseline=base,
        lora=lora,
        metrics=results,
        limits=evidence_limits(config, len(samples), base, lora),
        elapsed_s=elapsed_s,
    )


def primary_metric(r: EvalReport) -> str:
    """The metric promotion decides on: the config's primary_metric, else the first one
    (reports from before the setting existed)."""
    return str(r.config.get("primary_metric") or next(iter(r.metrics)))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_markdown(r: EvalReport) -> str:
    """The report as Markdown: setup, the paired results per metric, and the limits."""
    c = r.config
    lines = [
        "# Evaluation: base model + prompt vs LoRA",
        "",
        f"- Endpoint: `{c['base_url']}`; created {r.created}; {r.elapsed_s:.1f} s",
        f"- Baseline: `{r.baseline.model}` + "
        + (
            f"system prompt {c['system_prompt']!r}"
            if c.get("system_prompt")
            else "no system prompt override"
        )
        + f" + {len(c['few_shot'])} few-shot example(s)",
        f"- Candidate: `{r.lora.model}` on each item's own prompt",
        f"- Decoding: greedy (temperature 0), max_tokens {c['max_tokens']}, concurrency {c['concurrency']}",
        "",
        "## Frozen test split (this evaluation)",
        "",
        f"Data: `{r.test.ref}` ({r.test.digest}), n = {r.n} paired items. "
        f"BCa bootstrap of mean(LoRA − baseline): {int(next(iter(r.metrics.values())).confidence * 100)}% CI, "
        f"{next(iter(r.metrics.values())).resamples} resamples, seed {c['seed']}.",
        "",
        "| metric | baseline | LoRA | difference | CI | wins/losses/ties | sign test p | verdict |",
        "|---|---:|---:|---:|---|---|---:|---|",
    ]
    for name, m in r.metrics.items():
        lines.append(
            f"| {name} | {m.baseline_mean:.3f} | {m.candidate_mean:.3f} | {m.mean_difference:+.3f} "
            f"| [{m.ci_low:+.3f}, {m.ci_high:+.3f}] | {m.wins}/{m.losses}/{m.ties} "
            f"| {'-' if m.p_value is None else f'{m.p_value:.3g}'} | **{m.verdict}** |"
        )
    lines += _rule_and_requests(r)
    lines += _evidence_section(r.adapter)
    lines += ["## What this evidence cannot show", ""]
    lines += [f"- {x}" for x in r.limits]
    lines += [
        "",
        "## Files",
        "",
        "- `samples.jsonl`: every prompt, output and score, one item per line",
        "- `report.json`: this report as data",
        "",
    ]
    return "\n".join(lines)


def _rule_and_requests(r: EvalReport) -> list[str]:
    """The verdict rule with the primary metric, and how the requests went."""
    return [
        "",
        "Verdict rule: improvement if the whole BCa interval is above 0 and the exact sign "
        "test on wins vs losses (ties dropped) gives p below 1 - confidence; regression if "
        "both point below 0; uncertain otherwise; too few items below "
        f"{minimum_items(next(iter(r.metrics.values())).confidence)} paired items (no exact "
        "test of fewer can reach that p). "
        f"Primary metric: {primary_metric(r)} (`lorastack promote` serves the adapter as "
        "`NAME@promoted` only on its improvement).",
        "",
        f"Requests: baseline {r.baseline.errors} failed, {r.baseline.truncated} cut at max_tokens, "
        f"mean latency {r.baseline.mean_latency_s:.2f} s; LoRA {r.lora.errors} failed, "
        f"{r.lora.truncated} cut, mean latency {r.lora.mean_latency_s:.2f} s.",
        "",
    ]


def _evidence_section(ev: TrainingEvidence | None) -> list[str]:
    """The report's training and validation section: what the adapter recorded."""
    lines: list[str] = []
    if ev is None:
        lines += ["## Training and validation", "", "No adapter given (--adapter): not shown.", ""]
    else:
        train_src = (
            f"`{ev.train_data.ref}` ({ev.train_data.digest}), {ev.train_data.note}"
            if ev.train_data
            else "the adapter's training data (not named in its manifest)"
        )
        val_src = (
            f"`{ev.validation_data.ref}` ({ev.validation_data.digest}), {ev.validation_data.note}"
            if ev.validation_data
            else "the adapter's validation split (not named in its manifest)"
        )
        lines += [
            "## Seen during training (not evidence of generalisation)",
            "",
            f"From adapter `{ev.adapter.ref}` ({ev.adapter.digest}): training-complete.json"
            + (f" and {ev.last_step_file}" if ev.last_step_file else "")
            + f". Data: {train_src}.",
            "",
        ]
        lines += [f"- {k}: {_fmt(v)}" for k, v in ev.training.items()] or ["- (none recorded)"]
        lines += [
            "",
            "## Validation (held out from training, used to choose checkpoints)",
            "",
            f"Data: {val_src}.",
            "",
        ]
        lines += [f"- {k}: {_fmt(v)}" for k, v in ev.validation.items()] or ["- (none recorded)"]
        lines.append("")
    return lines


def write_report(r: EvalReport, samples: list[Sample], out_dir: Path) -> None:
    """Write samples.jsonl, report.json and report.md into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "samples.jsonl").open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.model_dump(mode="json"), ensure_ascii=False) + "\n")
    (out_dir / "report.json").write_text(
        r.model_dump_json(indent=2, exclude={"published"}) + "\n", encoding="utf-8"
    )
    (out_dir / "report.md").write_text(render_markdown(r), encoding="utf-8")
