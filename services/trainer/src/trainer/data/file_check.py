"""`lorastack data check`: every problem of every line of a dataset file, in one pass.

Reads the file line by line (never all of it at once) and, per line: the JSON and the
chat schema (`lorastack.chat_data`), special tokens inside contents, the chat template
(each target rendered verbatim), the end-of-turn token after every target, and the token
lengths. Each line keeps only fixed-size numbers (three 64-bit hashes, its length and
line number: ~40 bytes), so memory grows with the line count, not with the text. After
the pass the hashes give the duplicate and near-duplicate groups (with the line numbers
of each member), the split every conversation lands in (the same one `make_splits`
picks: `split_groups` over the prompt groups) and so which over-long samples are
refused and which test samples leak into training.

Owns: the pass, the report it fills (`PreflightReport`, with `line_problems` and the
groups), its verdict and exit code. Does not own: what makes one sample bad
(`encoding.check_sample`, on every core), the split rule (`splits.split_groups`).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lorastack.chat_data import Conversation, parse_line
from trainer.config import RunConfig
from trainer.data.encoding import CHUNK, default_workers, encode_all
from trainer.data.preflight import (
    Lengths,
    LineProblem,
    PreflightReport,
    judge_lengths,
)
from trainer.data.samples import end_of_turn_id
from trainer.data.splits import TEST, TRAIN, normalise, prompt_key, split_groups

SPLIT_NAMES = ("train", "validation", "test")
MAX_LINE_PROBLEMS = 100_000  # kept in the report; beyond, only counted


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No library noise in the report: transformers warns when a text is longer than the
    tokenizer's model_max_length, which is the very thing the report states in its own
    words (and a sample over max_seq_len is never truncated)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _progress(total_bytes: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="checking",
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.5,
    )


class _Groups:
    """Per-line hashes (numpy arrays after the pass) and what they group."""

    def __init__(self) -> None:
        self.lines = array("Q")  # line number of each parsed conversation
        self.exact = array("Q")  # hash of the conversation's JSON
        self.near = array("Q")  # hash of it after `normalise` (case, punctuation)
        self.prompt = array("Q")  # hash of `prompt_key`: what decides the split

    def add(self, line: int, conv: Conversation) -> None:
        text = conv.to_json()
        self.lines.append(line)
        self.exact.append(_h64(text))
        self.near.append(_h64(normalise(text)))
        self.prompt.append(_h64(prompt_key(conv)))

    def splits(self, validation: float, test: float, seed: int) -> np.ndarray:
        """The split code of every conversation, as `make_splits` would assign it."""
        keys = np.frombuffer(self.prompt, dtype=np.uint64)
        _, first, inverse, sizes = np.unique(
            keys, return_index=True, return_inverse=True, return_counts=True
        )
        order = np.argsort(first, kind="stable")  # groups in order of first appearance
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        where = np.array(split_groups(sizes[order].tolist(), validation, test, seed))
        return np.asarray(where[rank[inverse]]) if len(keys) else np.zeros(0, dtype=np.int64)

    def groups(self, hashes: array) -> list[np.ndarray]:
        """Indices (into `lines`) of every group of 2+ equal hashes, in line order."""
        keys = np.frombuffer(hashes, dtype=np.uint64)
        if not len(keys):
            return []
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        repeated = sorted_keys[1:] == sorted_keys[:-1]  # position i equals i + 1
        member = np.zeros(len(keys), dtype=bool)
        member[1:] |= repeated
        member[:-1] |= repeated
        order, sorted_keys = order[member], sorted_keys[member]  # only lines with a twin
        cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
        out = np.split(order, cuts) if len(order) else []
        out.sort(key=lambda g: int(g[0]))
        return out


def scan_file(
    path: Path,
    source: str,
    tokenizer: Any,
    config: RunConfig,
    *,
    progress: bool = False,
) -> PreflightReport:
    """Check every line of `path` against `config` (see the module docstring)."""
    report = PreflightReport(source=source, max_seq_len=config.max_seq_len, counts={}, by_line=True)
    eot = end_of_turn_id(tokenizer)
    specials = [t for t in tokenizer.all_special_tokens if t]
    hashes = _Groups()
    lengths = array("I")  # tokens of each conversation, 0 when it cannot be encoded
    parts: dict[int, dict[str, int]] = {}  # line -> parts, for over-long lines only
    longest: dict[str, int] = {}
    supervised = array("Q")  # supervised tokens of each conversation
    problems = 0

    def problem(line: int, kind: str, message: str) -> None:
        nonlocal problems
        problems += 1
        if len(report.line_problems) < MAX_LINE_PROBLEMS:
            report.line_problems.append(LineProblem(line=line, kind=kind, message=message))

    pending: list[tuple[int, Conversation]] = []  # parsed, not yet encoded
    batch = CHUNK * max(1, default_workers())  # a chunk per core and flush

    def flush() -> None:
        """Encode the pending conversations (one tokenizer call) and record what they are."""
        results = encode_all([c for _, c in pending], tokenizer, config.loss_on, specials, eot)
        for (line, _), (s, bad) in zip(pending, results, strict=True):
            for kind, message in bad:
                problem(line, kind, message)
            lengths.append(s.length if s is not None else 0)
            supervised.append(s.supervised if s is not None else 0)
            if s is not None:
                if s.length > config.max_seq_len:
                    parts[line] = dict(s.parts)
                for k, v in (*s.parts.items(), ("total", s.length)):
                    longest[k] = max(longest.get(k, 0), v)
        pending.clear()

    with (
        quiet_transformers(),
        path.open("rb") as f,
        _progress(path.stat().st_size, progress) as bar,
    ):
        line = 0
        for raw in f:
            line += 1
            bar.update(len(raw))
            if not raw.strip():
                continue
            conv = parse_line(raw, line)
            if isinstance(conv, str):
                problem(line, "schema", conv)
                continue
            hashes.add(line, conv)
            pending.append((line, conv))
            if len(pending) >= batch:
                flush()
        flush()
    report.line_problems.sort(key=lambda p: p.line)
    report.lines = line
    report.longest = longest
    split_of = _after_pass(report, config, hashes, np.frombuffer(lengths, dtype=np.uint32), parts)
    train = split_of == TRAIN
    report.supervised_tokens = int(np.frombuffer(supervised, dtype=np.uint64)[train].sum())
    if problems > len(report.line_problems):
        report.warnings.append(
            f"{problems} line problems; the first {len(report.line_problems)} are listed"
        )
    _verdicts(report, config, problems)
    return report


def _after_pass(
    report: PreflightReport,
    config: RunConfig,
    hashes: _Groups,
    lengths: np.ndarray,
    parts: dict[int, dict[str, int]],
) -> np.ndarray:
    """Counts, duplicate groups, leaks and over-long samples; returns each conversation's
    split code."""
    lines = np.frombuffer(hashes.lines, dtype=np.uint64)
    sp = config.split
    where = hashes.splits(sp.validation, sp.test, sp.seed)
    report.counts = {name: int((where == code).sum()) for code, name in enumerate(SPLIT_NAMES)}
    report.conversations = len(lines)

    exact = hashes.groups(hashes.exact)
    report.duplicate_groups = [[int(lines[i]) for i in g] for g in exact]
    report.exact_duplicates = sum(len(g) - 1 for g in exact)
    exact_of = {int(i): k for k, g in enumerate(exact) for i in g}
    for g in hashes.groups(hashes.near):
        members = {exact_of.get(int(i), -1 - int(i)) for i in g}
        if len(members) > 1:  # not all one exact group: they differ in case/punctuation
            report.near_duplicate_groups.append([int(lines[i]) for i in g])
            report.near_duplicates += len(members) - 1
        codes = {int(where[i]) for i in g}
        if TEST in codes and codes - {TEST}:
            report.leaks += [int(lines[i]) for i in g if where[i] == TEST]
    report.leaks.sort()

    for i in np.flatnonzero(lengths > config.max_seq_len):
        line, code = int(lines[i]), int(where[i])
        if code == TEST:
            report.warnings.append(
                f"line {line} (test) has {int(lengths[i])} tokens > max_seq_len (not trained on)"
            )
            continue
        report.overlong.append(
            Lengths(split=SPLIT_NAMES[code], number=line, total=int(lengths[i]), **parts[line])
        )
        if config.dataset.drop_overlong:
            report.dropped += 1
    return where


def _verdicts(report: PreflightReport, config: RunConfig, problems: int) -> None:
    kinds: dict[str, int] = {}
    for p in report.line_problems:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    if problems:
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        report.problems.append(f"{problems} line problem(s) ({summary}): fix or remove those lines")
    judge_lengths(report, config)
    if report.counts.get("train", 0) == 0:
        report.problems.append("no conversation is left for the training split")
    if report.leaks:
        report.problems.append(
            f"{len(report.leaks)} test sample(s) also appear in train/validation "
            f"(lines {report.leaks[:10]}): the frozen test would not measure generalisation; "
            "deduplicate the source"
        )
    if report.duplicate_groups:
        report.warnings.append(
            f"{report.exact_duplicates} exact duplicate(s) in {len(report.duplicate_groups)} "
            "group(s) (lines listed above)"
        )
    if report.near_duplicate_groups:
        report.warnings.append(
            f"{report.near_duplicates} near duplicate(s) in {len(report.near_duplicate_groups)} "
            "group(s) (lines listed above)"
        )
