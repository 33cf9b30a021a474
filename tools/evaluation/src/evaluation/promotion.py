"""Promotion on evidence: may this adapter be served as `NAME@promoted`?

Owns the rule and the search for its evidence, not the label (`lorastack.store.labels`)
nor serving (the inference supervisor follows the label):

    evidence   the newest published evaluation (kind "report") whose parent of role
               "adapter" has the adapter's digest (`lorastack eval --adapter REF` records
               it), or the report given with --report
    metric     the report's primary metric (`primary_metric` in the eval config; the
               first scorer when unset)
    rule       its verdict must be "improvement" (the whole BCa interval above 0 and the
               exact sign test below 1 - confidence) on at least `minimum_items` paired
               items; "too few items", "uncertain" and "regression" are refused with the
               numbers, and so is a report whose verdict lacks the exact test (written by
               an older lorastack) or whose n is under the minimum, whatever it says

`force=True` moves the label without that verdict; the reason, who and when go into the
label's record beside whatever evidence there was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from evaluation.eval_report import EvalReport, primary_metric
from evaluation.verdict import PairedResult, minimum_items
from lorastack.errors import ConfigError, NotFound, Refused
from lorastack.manifest import Manifest, split_ref
from lorastack.store import ArtifactStore, LabelRecord

DEFAULT_LABEL = "promoted"


@dataclass(frozen=True)
class Evidence:
    """A published evaluation of the adapter, its primary metric and that metric's result."""

    report: Manifest  # the published evaluation
    metric: str  # its primary metric
    result: PairedResult

    @property
    def verdict(self) -> str:
        """The stored verdict, unless the report cannot carry an improvement: fewer items
        than the exact test needs, or no exact test at all (an older report)."""
        m = self.result
        if m.n < minimum_items(m.confidence):
            return "too few items"
        if m.p_value is None and m.verdict == "improvement":
            return "no exact test"
        return m.verdict

    def numbers(self) -> str:
        """The primary metric's figures and verdict on one line, for a refusal or a log."""
        m = self.result
        return (
            f"{self.metric}: baseline {m.baseline_mean:.3f}, adapter {m.candidate_mean:.3f} "
            f"(difference {m.mean_difference:+.3f}), {m.confidence:.0%} CI "
            f"[{m.ci_low:+.3f}, {m.ci_high:+.3f}], n = {m.n} (minimum "
            f"{minimum_items(m.confidence)}), wins/losses/ties {m.wins}/{m.losses}/{m.ties}"
            + (f", sign test p = {m.p_value:.3g}" if m.p_value is not None else "")
            + f": {self.verdict}"
        )

    def as_record(self) -> dict[str, Any]:
        """What the label's record keeps of it."""
        return {
            "report": self.report.ref,
            "report_digest": self.report.digest,
            "metric": self.metric,
            **self.result.model_dump(
                include={"n", "baseline_mean", "candidate_mean", "mean_difference",
                         "ci_low", "ci_high", "confidence", "p_value", "min_items"}
            ),
            "verdict": self.verdict,
        }  # fmt: skip


@dataclass(frozen=True)
class Promotion:
    """A promotion done: the label record, the adapter, and the evidence (None when forced)."""

    record: LabelRecord
    adapter: Manifest
    evidence: Evidence | None


def names_adapter(report: Manifest, adapter: Manifest) -> bool:
    """Whether `report` is an evaluation report whose parents name `adapter` (by digest)."""
    return report.kind == "report" and any(
        p.role == "adapter" and p.digest == adapter.digest for p in report.parents
    )


def find_reports(store: ArtifactStore, adapter: Manifest) -> list[Manifest]:
    """Published evaluations of `adapter`, newest first: its run's folder is searched
    first (`<run>/eval`), the whole store only when that holds none."""
    run = adapter.name.rpartition("/")[0]
    for prefix in ([run + "/"] if run else []) + [""]:
        found = [m for m in store.ls(prefix) if names_adapter(m, adapter)]
        if found:
            return sorted(found, key=lambda m: (m.created, m.name, m.version), reverse=True)
    return []


def read_evidence(store: ArtifactStore, report: Manifest) -> Evidence:
    """The primary metric's result from the report's verified report.json."""
    path = store.fetch(report) / "report.json"
    try:
        parsed = EvalReport.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as e:
        raise Refused(
            f"{report.ref} holds no readable evaluation report.json ({type(e).__name__})",
            "give a report published by 'lorastack eval' (--report NAME:VERSION)",
        ) from None
    metric = primary_metric(parsed)
    if metric not in parsed.metrics:
        raise Refused(
            f"{report.ref}: its primary metric {metric!r} has no result "
            f"(metrics: {', '.join(parsed.metrics)})",
            "evaluate again with a primary_metric among the scorers",
        )
    return Evidence(report, metric, parsed.metrics[metric])


def evidence_for(store: ArtifactStore, adapter: Manifest, report_ref: str | None) -> Evidence:
    """The evaluation that decides: `report_ref` if given (it must name the adapter), else
    the newest one that names it."""
    if report_ref:
        report = store.resolve(report_ref)
        if not names_adapter(report, adapter):
            raise Refused(
                f"{report.ref} is not an evaluation of {adapter.ref} "
                f"(no parent of role 'adapter' with digest {adapter.digest[:19]}…)",
                f"evaluate it: lorastack eval ... --adapter {adapter.ref}",
            )
        return read_evidence(store, report)
    reports = find_reports(store, adapter)
    if not reports:
        raise NotFound(
            f"no published evaluation names {adapter.ref} in {store.url}",
            f"evaluate it first: lorastack eval --test RUN/test --base-model BASE "
            f"--lora-model SERVED --adapter {adapter.ref}; or promote anyway with "
            "--force --reason 'WHY'",
        )
    return read_evidence(store, reports[0])


def refusal(adapter: Manifest, ev: Evidence) -> Refused:
    """The Refused error for an adapter whose evaluation is no improvement: why, what to do."""
    m = ev.result
    floor = minimum_items(m.confidence)
    what = {
        "regression": "the adapter is worse than the baseline on this data",
        "uncertain": "this data cannot tell the adapter from the baseline",
        "too few items": f"{m.n} paired items are too few: at {m.confidence:.0%} confidence "
        f"no exact test can show an improvement on fewer than {floor} (evaluate at least "
        f"{floor} items, without --limit below it)",
        "no exact test": "this report predates the exact sign test (evaluate it again)",
    }.get(ev.verdict, f"the verdict is {ev.verdict!r}")
    return Refused(
        f"refused to promote {adapter.ref}: its evaluation {ev.report.ref} says "
        f"{ev.verdict!r} on the primary metric {ev.metric!r}, not 'improvement'\n"
        f"  {ev.numbers()}",
        f"{what}. Promotion needs the whole CI above 0 and the sign test below "
        f"{1 - m.confidence:.2g} on at least {floor} items: train further or evaluate on more "
        "test items and publish that evaluation; or promote anyway with --force --reason 'WHY'",
    )


def promote(
    store: ArtifactStore,
    ref: str,
    *,
    label: str = DEFAULT_LABEL,
    force: bool = False,
    reason: str = "",
    report_ref: str | None = None,
) -> Promotion:
    """Move `NAME@label` to the adapter `ref` on an improvement verdict (or `force`)."""
    name, version, given_label = split_ref(ref)
    if given_label:
        raise ConfigError(
            f"promote a version, not a label: {ref!r}", f"write {name}[:VERSION] (default latest)"
        )
    if force and not reason.strip():
        raise ConfigError("--force needs --reason", "say why, e.g. --reason 'hotfix for #31'")
    adapter = store.manifest(name, version)
    if adapter.kind != "adapter":
        raise ConfigError(
            f"{adapter.ref} is a {adapter.kind}, not an adapter",
            "promote an adapter artifact, e.g. RUN/adapter:VERSION",
        )
    try:
        evidence: Evidence | None = evidence_for(store, adapter, report_ref)
    except (NotFound, Refused):
        if not force:
            raise
        evidence = None
    if evidence is not None and evidence.verdict != "improvement" and not force:
        raise refusal(adapter, evidence)
    forced = evidence is None or evidence.verdict != "improvement"
    record = store.move_label(
        label,
        adapter,
        forced=forced,
        reason=reason.strip(),
        evidence=evidence.as_record() if evidence else {},
    )
    return Promotion(record, adapter, evidence)
