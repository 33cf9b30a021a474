"""The dataset check run by `lorastack data check` and before every training run.

Owns the report: token lengths per part (system/context, history, target), samples
over the maximum (refused unless `dataset.drop_overlong`, then dropped and counted),
targets that the template does not render verbatim or that do not end with the
end-of-turn token, special tokens inside contents, exact and near duplicates, leaks
between the frozen test split and the training data, and the disk budget. Schema errors
(with line numbers) are raised earlier by `lorastack.chat_data.load_jsonl`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from trainer.config import RunConfig
from trainer.data.encoding import encode_all
from trainer.data.samples import Sample, end_of_turn_id
from trainer.data.splits import Splits, normalise, prompt_key
from trainer.errors import PreflightRefused
from trainer.model.memory import checkpoint_bytes, human, lora_params

LOG_BUDGET = 64 << 20  # bytes kept for metrics, logs and plots


class Lengths(BaseModel):
    """One sample's token counts, part by part."""

    split: str
    number: int  # conversation number in the source file (1-based)
    system: int  # tokens
    history: int
    target: int
    total: int


class LineProblem(BaseModel):
    """A problem of one line of the source file."""

    line: int  # 1-based line of the source file
    kind: str  # schema | special_token | template | eos
    message: str


class PreflightReport(BaseModel):
    """What the data preflight found: counts, lengths, problems and duplicates."""

    source: str
    max_seq_len: int
    counts: dict[str, int]
    by_line: bool = False  # numbers are file lines (data check), else conversation numbers
    lines: int = 0  # lines read (data check)
    conversations: int = 0  # lines that hold a valid conversation (data check)
    line_problems: list[LineProblem] = []  # every problem of every line (data check)
    duplicate_groups: list[list[int]] = []  # lines of each group of exact duplicates
    near_duplicate_groups: list[list[int]] = []  # equal up to case/punctuation
    longest: dict[str, int] = {}  # tokens, per part, over train + validation
    supervised_tokens: int = 0  # in train
    overlong: list[Lengths] = []
    dropped: int = 0
    invalid: list[str] = []
    exact_duplicates: int = 0
    near_duplicates: int = 0
    leaks: list[int] = []  # test conversation numbers also present in train/validation
    disk: dict[str, int | str] = {}
    problems: list[str] = []
    warnings: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        return "refused" if self.problems else "warnings" if self.warnings else "ok"

    @property
    def exit_code(self) -> int:
        """0 ok, 1 warnings only (trainable), 3 refused (Refused.exit_code)."""
        return {"ok": 0, "warnings": 1, "refused": 3}[self.verdict]

    def to_json(self) -> str:
        """The report as indented JSON, its verdict included."""
        data = self.model_dump(mode="json")
        data["verdict"] = self.verdict
        return json.dumps(data, indent=1)

    def _render_lines(self) -> list[str]:
        out: list[str] = []
        if self.lines:
            out.append(f"  lines: {self.lines}, conversations: {self.conversations}")
        for p in self.line_problems[:200]:
            out.append(f"  line {p.line}: {p.kind}: {p.message}")
        if len(self.line_problems) > 200:
            out.append(f"  ... and {len(self.line_problems) - 200} more (all of them: --json)")
        for title, groups in (
            ("exact duplicates", self.duplicate_groups),
            ("near duplicates", self.near_duplicate_groups),
        ):
            for g in groups[:20]:
                shown = ", ".join(map(str, g[:12])) + (
                    f", ... ({len(g)} in all)" if len(g) > 12 else ""
                )
                out.append(f"  {title}: lines {shown}")
            if len(groups) > 20:
                out.append(f"  ... and {len(groups) - 20} more {title} groups (--json)")
        return out

    def render(self) -> str:
        """The report as lines of text for the terminal."""
        out = [f"dataset check: {self.source}"]
        out += self._render_lines()
        out.append("  samples: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        if self.longest:
            out.append(
                "  longest (tokens): "
                + ", ".join(f"{k} {v}" for k, v in self.longest.items())
                + f"  (max_seq_len {self.max_seq_len})"
            )
        out.append(f"  supervised tokens in train: {self.supervised_tokens}")
        out.append(
            f"  duplicates: {self.exact_duplicates} exact, {self.near_duplicates} near "
            f"(equal up to case/punctuation); test samples leaking into training: {len(self.leaks)}"
            + (f" (lines {self.leaks[:10]})" if self.by_line and self.leaks else "")
        )
        if self.disk:
            out.append(
                f"  disk: needs ~{human(int(self.disk['needed']))} "
                f"(base {human(int(self.disk['base']))}, {self.disk['keep']} checkpoints of "
                f"{human(int(self.disk['checkpoint']))}, adapter, logs), "
                f"free {human(int(self.disk['free']))} at {self.disk['path']}"
            )
        if self.overlong:
            verb = "dropped" if self.dropped else "refused"
            out.append(f"  {len(self.overlong)} sample(s) longer than {self.max_seq_len} ({verb}):")
            out.append(
                f"    {'split':10} {'line' if self.by_line else '#':>6} {'system':>7} {'history':>8} {'target':>7} {'total':>6}"
            )
            for x in self.overlong[:50]:
                out.append(
                    f"    {x.split:10} {x.number:>6} {x.system:>7} {x.history:>8} "
                    f"{x.target:>7} {x.total:>6}"
                )
            if len(self.overlong) > 50:
                out.append(f"    ... and {len(self.overlong) - 50} more")
        for line in self.invalid[:20]:
            out.append(f"  invalid: {line}")
        out += [f"  warning: {w}" for w in self.warnings]
        out += [f"  PROBLEM: {p}" for p in self.problems]
        out.append(
            "  verdict: "
            + {"ok": "ok", "warnings": "ok, with warnings", "refused": "REFUSED"}[self.verdict]
        )
        return "\n".join(out)


def judge_lengths(report: PreflightReport, config: RunConfig) -> None:
    """The verdict on the over-long samples listed in `report` (refused, or dropped as asked)."""
    if report.overlong and not config.dataset.drop_overlong:
        report.problems.append(
            f"{len(report.overlong)} sample(s) exceed max_seq_len={config.max_seq_len} tokens; "
            "nothing is truncated: raise max_seq_len, shorten those samples, or drop them "
            "explicitly with dataset.drop_overlong=true"
        )
    if report.dropped:
        report.warnings.append(f"dropped {report.dropped} over-long sample(s) as asked")


def _free_bytes(path: Path) -> tuple[int, Path]:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, p


def check_dataset(
    splits: Splits,
    tokenizer: Any,
    config: RunConfig,
    *,
    model_config: dict[str, Any] | None = None,
    base_bytes: int = 0,
    disk_path: Path | None = None,
) -> tuple[PreflightReport, dict[str, list[Sample]]]:
    """Encode every split and check it. Returns the report and the encoded train and
    validation samples (over-long ones removed only when dropping was asked for)."""
    report = PreflightReport(
        source=splits.source, max_seq_len=config.max_seq_len, counts=splits.counts()
    )
    encoded: dict[str, list[Sample]] = {}
    for name, items in (
        ("train", splits.train),
        ("validation", splits.validation),
        ("test", splits.test),
    ):
        encoded[name] = _encode_split(report, name, items, tokenizer, config)
    report.supervised_tokens = sum(s.supervised for s in encoded["train"])
    if report.invalid:
        report.problems.append(
            f"{len(report.invalid)} sample(s) cannot be trained on (see 'invalid' lines): fix or "
            "remove them"
        )
    judge_lengths(report, config)
    if not encoded["train"]:
        report.problems.append("no trainable sample is left in the training split")

    _check_overlap(report, splits)

    if model_config is not None and disk_path is not None:
        check_disk(report, config, model_config, base_bytes, disk_path)
    return report, encoded


def _encode_split(
    report: PreflightReport, name: str, items: list[Any], tokenizer: Any, config: RunConfig
) -> list[Sample]:
    """Encode split `name`, noting in `report` what cannot be trained on, what is too long
    and the longest parts; returns the samples kept."""
    eot = end_of_turn_id(tokenizer)
    specials = [t for t in tokenizer.all_special_tokens if t]
    kept: list[Sample] = []
    results = encode_all([it.conv for it in items], tokenizer, config.loss_on, specials, eot)
    for it, (s, bad) in zip(items, results, strict=True):
        if bad:
            report.invalid.append(f"{name} #{it.number}: {bad[0][1]}")
            continue
        assert s is not None
        if s.length > config.max_seq_len:
            if name == "test":
                report.warnings.append(
                    f"test #{it.number} has {s.length} tokens > max_seq_len (not trained on)"
                )
            else:
                report.overlong.append(
                    Lengths(split=name, number=it.number, total=s.length, **s.parts)
                )
                if config.dataset.drop_overlong:
                    report.dropped += 1
                    continue
        kept.append(s)
        if name != "test":
            for k, v in s.parts.items():
                report.longest[k] = max(report.longest.get(k, 0), v)
            report.longest["total"] = max(report.longest.get("total", 0), s.length)
    return kept


def _check_overlap(report: PreflightReport, splits: Splits) -> None:
    """Count duplicates in train and validation, and the test samples they also hold."""
    exact: set[str] = set()
    near: set[str] = set()
    for it in splits.train + splits.validation:
        raw, norm = it.conv.to_json(), normalise(it.conv.to_json())
        if raw in exact:
            report.exact_duplicates += 1
        elif norm in near:
            report.near_duplicates += 1
        exact.add(raw)
        near.add(norm)
    seen_prompts = {prompt_key(it.conv) for it in splits.train + splits.validation}
    report.leaks = [
        it.number
        for it in splits.test
        if prompt_key(it.conv) in seen_prompts or normalise(it.conv.to_json()) in near
    ]
    if report.leaks:
        report.problems.append(
            f"{len(report.leaks)} test sample(s) also appear in train/validation "
            f"(numbers {report.leaks[:10]}): the frozen test would not measure generalisation; "
            "deduplicate the source"
        )
    if report.exact_duplicates:
        report.warnings.append(f"{report.exact_duplicates} exact duplicate(s) in the training data")


def check_disk(
    report: PreflightReport,
    config: RunConfig,
    model_config: dict[str, Any],
    base_bytes: int,
    disk_path: Path,
) -> None:
    """Fill `report.disk` and refuse when the run's files would not fit."""
    lp = lora_params(model_config, config.lora.r, config.lora.target_modules)
    ckpt = checkpoint_bytes(lp)
    needed = base_bytes + config.keep_checkpoints * ckpt + lp * 4 + LOG_BUDGET
    free, where = _free_bytes(disk_path)
    report.disk = {
        "needed": needed,
        "free": free,
        "base": base_bytes,
        "checkpoint": ckpt,
        "keep": config.keep_checkpoints,
        "path": str(where),
    }
    if needed > free:
        report.problems.append(
            f"not enough disk: needs ~{human(needed)}, {human(free)} free at {where}; "
            "free space or lower keep_checkpoints"
        )


def refuse_unless_ok(report: PreflightReport) -> None:
    """Raise PreflightRefused, with the rendered report, unless the report is ok."""
    if not report.ok:
        raise PreflightRefused(
            report.render(), "fix the problems listed above, then run 'lorastack data check' again"
        )
